"""Training checkpoints: everything a continuation needs, in the one checkpoint format.

``<output_dir>/checkpoints/`` is a megarl checkpoint root (``megarl_checkpoint.json``, ``tokenizer/``, ``latest``):
the actor is stored under its plain Megatron names, so the export and verify tools read a training checkpoint like a
converted one. Each ``iter_N/`` holds one Megatron distributed checkpoint with

- ``actor`` / ``critic.*`` weights and their optimizers (the distributed optimizer ``fully_reshardable``, so both
  reshard to another TP/PP/DP on load), the learning-rate schedulers (plain dicts);
- every rank's RNG states (python, numpy, torch, CUDA, Megatron's tracker) as one ``ShardedObject`` per global rank;
- ``trainer_state.json`` (plain JSON: the trainer state, the layout, and the metrics history for the curve);
- ``manifest.json``: every file's size and SHA-256, written last.

With resource pools a pool other than the actor's writes its models (the critic, and the reference's nothing: it is
always the initial weights) as its own distributed checkpoint in ``iter_N/critic/``, with its ranks' RNG states;
loading reads the critic from there when it exists, else from ``iter_N/`` (a colocated save), at any layout.

A save writes ``iter_N.tmp/`` and makes every file and directory in it durable (fsync: megatron's writers their
shards, the rank that wrote each of the other files that file, the leader the directories), writes the manifest, then
publishes it with renames only: an ``iter_N`` already there (a step saved again) is renamed aside first and deleted
after, so at every moment a complete checkpoint of the newest step is on disk under ``iter_N`` or ``iter_N.tmp``
(``locate.finish_interrupted_saves`` completes a publish that a kill cut); then ``latest``; older checkpoints are
pruned last. A directory without a complete manifest is never loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megarl.checkpoint import format as ckpt
from megarl.checkpoint.locate import CRITIC_DIR, REPLACED_SUFFIX, TRAINER_STATE, complete_iterations, fsync_path
from megarl.checkpoint.manifest import read_manifest, verify_manifest, write_manifest
from megarl.compat import checkpoint_writer
from megarl.compat.cpu import megatron_mode
from megarl.compat.megatron_fixes import fix_parameter_state_load, prime_optimizer_state, unshare_optimizer_steps
from megarl.compat.megatron_speed import fused_adam

OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def rng_states() -> dict:
    """This rank's RNG states: python, numpy, torch, CUDA and Megatron's tracker (what a checkpoint saves)."""
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_states(s: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["tracker"])


def _rng_object(data):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _has_lora(model) -> bool:
    from megarl.lora import has_lora  # here (and below): lora imports checkpoint (its export reads checkpoints)

    return has_lora(model.module)


def _sharded_state(models, *, loading: bool, rng: bool | dict, names=("actor", "critic")) -> dict:
    """The dist-checkpoint state dict of the actor (plain names) and critic (``critic.`` names) among ``names``,
    their optimizers and schedulers, and (``rng``) this rank's RNG states (a dict: those, as captured earlier)."""
    state = {}
    for name, prefix in (("actor", ""), ("critic", "critic.")):
        model = getattr(models, name)
        if model is None or name not in names:
            continue
        optim = getattr(models, f"{name}_optim")
        if loading:
            prime_optimizer_state(optim)
        if _has_lora(model):  # only the adapters (the frozen base is model.path's; its fingerprint is checked)
            from megarl.lora.checkpoint import adapter_sharded_state

            model_sd = adapter_sharded_state(model.module, prefix)
        else:
            model_sd = model.module.sharded_state_dict(prefix=prefix)
        state[name] = model_sd
        state[f"{name}_optim"] = optim.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIM_METADATA)
        state[f"{name}_sched"] = getattr(models, f"{name}_sched").state_dict()
    if rng:
        state["rng"] = _rng_object(None if loading else rng if isinstance(rng, dict) else rng_states())
    return state


def save_training(root: str, step: int, models, trainer_state: dict, *, keep_last: int = 0, before_manifest=None,
                  finishes: bool = True, barrier=None, extra: dict | None = None,
                  rng: dict | None = None, fault=None) -> dict:  # fmt: skip
    """Collective: write ``<root>/iter_<step>`` (see the module docstring) and point ``latest`` at it; then delete
    all but the newest ``keep_last`` complete checkpoints. The root's ``megarl_checkpoint.json`` must exist.
    ``before_manifest()`` runs between the shards and the manifest, ``fault(point)`` at the publish's points
    ('publish': the manifest written; 'replace': an older iter_N set aside; 'prune': an old checkpoint renamed for
    deletion) on the leader (fault injection); ``extra``: file name ->
    object, written beside the trainer state (``torch.save``; the batch in flight); ``rng``: this rank's RNG states
    to save (``rng_states()`` captured when the saved state held; default: now). Returns sizes/times.

    Resource pools: every rank of the launch calls it; ``barrier`` spans the launch; the actor's pool ``finishes``
    (its rank 0 writes the trainer state, the manifest, the rename); another pool writes its models (``models``;
    None: nothing) into ``iter_N/critic``."""
    barrier = barrier or dist.barrier
    t0 = time.perf_counter()
    lead = finishes and dist.get_rank() == 0
    final = os.path.join(root, ckpt.iter_dirname(step))
    tmp = final + ".tmp"
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    aside = f"{tmp}-{CRITIC_DIR}"  # written beside, moved in below (Megatron warns about a non-empty target)
    if models is not None:
        _write_models(models, tmp if finishes else aside, fresh=not finishes, rng=rng)
    if lead:
        ckpt.atomic_write(os.path.join(tmp, TRAINER_STATE), json.dumps(trainer_state))
        for name, obj in (extra or {}).items():
            torch.save(obj, os.path.join(tmp, name))
        _fsync_files(os.path.join(tmp, name) for name in extra or {})
    barrier()
    report = {}
    if finishes:
        if lead and os.path.isdir(aside):
            os.rename(aside, os.path.join(tmp, CRITIC_DIR))
        dist.barrier()  # every rank of the pool sees the critic's part before the manifest hashes it
        if before_manifest is not None:
            before_manifest()
        t_write = time.perf_counter() - t0
        if lead:  # every file is durable before the manifest vouches for it (the shards: their writers, below)
            _fsync_paths(tmp)
        write_manifest(tmp)
        t_hash = time.perf_counter() - t0 - t_write
        dist.barrier()
        if lead:
            _publish(root, step, tmp, final, keep_last, fault or (lambda point: None))
        dist.barrier()
        size = sum(v["bytes"] for v in read_manifest(final)["files"].values())
        report = {"path": final, "bytes": size, "seconds": time.perf_counter() - t0, "hash_seconds": t_hash}
    barrier()
    return report


def _write_models(models, target: str, *, fresh: bool, rng: dict | None) -> None:
    """Collective over the models' ranks: their sharded state (and RNG states) into ``target`` (``fresh``: created
    empty first, by the pool's rank 0)."""
    from megatron.core import dist_checkpointing

    if fresh:
        if dist.get_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)
            os.makedirs(target)
        dist.barrier()  # the directory exists before the pool's ranks write into it
    checkpoint_writer.install()
    with megatron_mode():
        dist_checkpointing.save(
            _sharded_state(models, loading=False, rng=rng or True),
            target,
            content_metadata={"megarl_format_version": ckpt.FORMAT_VERSION, **OPTIM_METADATA},
        )
    if dist.get_rank() == 0:  # the shards' writers fsync them (megatron's use_fsync); its rank 0 wrote the rest
        _fsync_files(e.path for e in os.scandir(target) if e.is_file() and not e.name.endswith(".distcp"))


def _fsync_files(paths) -> None:
    """Make these files' contents durable (each from the process that wrote it: on a shared filesystem only the
    writing client's fsync flushes its cache)."""
    for path in paths:
        fsync_path(path)


def _fsync_paths(root: str) -> None:
    """``root`` and every directory under it: their entries (the files renamed or created in them) made durable."""
    fsync_path(root)
    for d, subdirs, _ in os.walk(root):
        for sub in subdirs:
            fsync_path(os.path.join(d, sub))


def _publish(root: str, step: int, tmp: str, final: str, keep_last: int, fault) -> None:
    """The finished ``tmp`` becomes ``final`` and ``latest``; all but the newest ``keep_last`` complete checkpoints
    are deleted (never the one just written). Renames only, each made durable before the next step: an older
    ``final`` (the step saved again) is renamed aside, ``tmp`` renamed in, the older one deleted."""
    fsync_path(tmp)  # the manifest
    fault("publish")
    replaced = final + REPLACED_SUFFIX
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        fsync_path(root)
        fault("replace")
    os.rename(tmp, final)
    fsync_path(root)
    ckpt.atomic_write(os.path.join(root, ckpt.LATEST_FILE), ckpt.iter_dirname(step) + "\n")
    fsync_path(root)
    shutil.rmtree(replaced, ignore_errors=True)
    if keep_last:
        for _, old in complete_iterations(root)[0][keep_last:]:
            if os.path.abspath(old) != os.path.abspath(final):
                # renamed first: a kill in the middle of the removal leaves an ``iter_N.tmp-pruned`` that the next
                # start removes as an interrupted save, not a half-deleted ``iter_N`` no later prune would see
                doomed = old.rstrip("/") + ".tmp-pruned"
                os.rename(old, doomed)
                fsync_path(root)
                fault("prune")
                shutil.rmtree(doomed, ignore_errors=True)


@dataclass
class Loaded:
    rng: dict | None
    """This rank's saved RNG states (apply with ``set_rng_states`` once nothing else will reseed), if asked for."""
    verify_seconds: float
    seconds: float
    """Verification and load together."""


def load_training(path: str, models, *, verify_hashes: bool = True, restore_rng: bool = True) -> Loaded:
    """Collective: verify ``path``'s manifest, then load weights, optimizers and schedulers into ``models`` at
    whatever layout they were built with (the critic from ``path/critic`` when a critic pool wrote it there). The RNG
    states come from the directory this rank's first model is read from."""
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    verify_manifest(path, hashes=verify_hashes)
    t_verify = time.perf_counter() - t0
    own_critic = os.path.isdir(os.path.join(path, CRITIC_DIR))
    sources = {"actor": path, "critic": os.path.join(path, CRITIC_DIR) if own_critic else path}
    present = [n for n in ("actor", "critic") if getattr(models, n) is not None]
    rng = None
    with megatron_mode():
        for directory in dict.fromkeys(sources[n] for n in present):  # one load per directory, the actor's first
            names = [n for n in present if sources[n] == directory]
            want_rng = restore_rng and rng is None
            state = dist_checkpointing.load(
                _sharded_state(models, loading=True, rng=want_rng, names=names), directory
            )
            rng = state["rng"] if want_rng else rng
            for name in names:
                _load_model(path, models, name, state)
    dist.barrier()
    return Loaded(rng, t_verify, time.perf_counter() - t0)


def _load_model(path: str, models, name: str, state: dict) -> None:
    model = getattr(models, name)
    if _has_lora(model):
        from megarl.lora.checkpoint import load_adapter_state

        load_adapter_state(model.module, state[name])
    else:
        weights = {k.removeprefix("critic.") if name == "critic" else k: v for k, v in state[name].items()}
        missing, unexpected = model.module.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ckpt.CheckpointError(f"{path}: {name} missing {missing}, unexpected {unexpected}")
    optim = getattr(models, f"{name}_optim")
    fix_parameter_state_load(optim)
    optim.load_state_dict(state[f"{name}_optim"])
    unshare_optimizer_steps(optim)
    fused_adam(optim)  # the load brought the saved groups' implementation flags along
    getattr(models, f"{name}_sched").load_state_dict(state[f"{name}_sched"])
