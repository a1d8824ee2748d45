"""Saves and loads of real training checkpoints (the tiny actor, Megatron's distributed checkpoint, one rank) for
tests/test_checkpoint_faults.py, as a process that a ``MEGARL_FAULT`` point of the publish may SIGKILL:

    python -m tests.checkpoint_fault_worker HF_DIR save ROOT KEEP_LAST STEP[:VARIANT] ...
    python -m tests.checkpoint_fault_worker HF_DIR load OUT ROOT ...
    python -m tests.checkpoint_fault_worker HF_DIR damaged OUT OUTPUT_DIR

``save`` writes the checkpoints in order, the actor's weights set to ``expected_weights(step, variant)`` for each
(a step saved twice has two variants), with ``fault=faults.fire`` as ``megarl train`` passes it. ``load`` starts as
``megarl train`` does on each root (``finish_interrupted_saves``, the interrupted saves removed, ``find_resume``)
and loads the checkpoint found into fresh models; OUT gets {root: (step, weights)}. ``damaged`` flips a byte in
the newest checkpoint of OUTPUT_DIR and asks ``megarl train``'s start (``job.verified_start``) where it starts,
then truncates a file of the next one and asks again; OUT gets both answers.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

import torch


def expected_weights(initial: dict[str, torch.Tensor], step: int, variant: int) -> dict[str, torch.Tensor]:
    """The weights saved at (``step``, ``variant``): the initial ones moved by a pattern of that pair."""
    out = {}
    for i, (name, w) in enumerate(sorted(initial.items())):
        gen = torch.Generator().manual_seed(1000 * step + 10 * variant + i)
        out[name] = w + 1e-3 * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    return out


def _models(hf_dir: str):
    from megarl.backend.models import build_rl_models
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.source import model_source
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    layout = ParallelLayout()
    init_distributed(layout, seed=1)
    cfg = load_config(None, [f"model.path={hf_dir}", "actor.optim.optimizer=adam"])
    return build_rl_models(cfg, spec, layout, model_source(hf_dir), 0, roles=("actor",)), spec


def _weights(models) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in models.actor.module.named_parameters()}


def save(hf_dir: str, root: str, keep_last: int, saves: list[str]) -> None:
    from megarl import faults
    from megarl.checkpoint import format as ckpt
    from megarl.checkpoint.training import save_training
    from megarl.compat.cpu import megatron_mode
    from megarl.models import read_hf_config

    models, spec = _models(hf_dir)
    models.actor.zero_grad_buffer()
    with megatron_mode():
        models.actor_optim.step()  # a step on zero gradients: Adam's states exist, as in a run
    initial = _weights(models)
    os.makedirs(root, exist_ok=True)
    ckpt.write_meta(root, {"family": spec.family, "hf_config": read_hf_config(hf_dir)})
    for item in saves:
        step, _, variant = item.partition(":")
        step, variant = int(step), int(variant or 0)
        with torch.no_grad():
            for name, p in models.actor.module.named_parameters():
                p.copy_(expected_weights(initial, step, variant)[name])
        state = {"state": {"step": step}, "layout": {}}
        save_training(root, step, models, state, keep_last=keep_last, before_manifest=lambda s=step: faults.fire(
            "save", s), fault=lambda point, s=step: faults.fire(point, s))  # fmt: skip


def load(hf_dir: str, out: str, roots: list[str]) -> None:
    from megarl.checkpoint.locate import find_resume, finish_interrupted_saves, read_trainer_state
    from megarl.checkpoint.training import load_training

    models, _ = _models(hf_dir)
    initial = _weights(models)
    result = {"initial": initial}
    for root in roots:
        finished = finish_interrupted_saves(root)
        for stale in glob.glob(os.path.join(root, "iter_*.tmp*")):  # as megarl train's start removes them
            shutil.rmtree(stale)
        found = find_resume(os.path.dirname(root))
        load_training(found.path, models, restore_rng=False)
        left = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
        result[root] = {"step": read_trainer_state(found.path)["state"]["step"], "weights": _weights(models),
                        "finished": finished, "left": left}  # fmt: skip
    torch.save(result, out)


def damaged(hf_dir: str, out: str, output_dir: str) -> None:
    from megarl.checkpoint.locate import find_resume
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.parallel.pools import Placement
    from megarl.run.job import verified_start

    init_distributed(ParallelLayout(), seed=1)
    cfg = load_config("configs/quickstart.yaml", [f"model.path={hf_dir}", f"trainer.output_dir={output_dir}",
                                                   "actor.parallel.tp=1", "trainer.total_steps=6"])  # fmt: skip
    spec = validate(cfg, world_size=1)
    answers = []
    for damage in ("flip", "truncate"):
        newest = find_resume(output_dir).path
        shard = max((os.path.join(newest, n) for n in os.listdir(newest)), key=os.path.getsize)
        data = bytearray(open(shard, "rb").read())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        with open(shard, "wb") as f:
            f.write(data if damage == "flip" else data[: len(data) // 2])
        start, notes = verified_start(cfg, spec, Placement.colocated())
        answers.append({"damaged": newest, "step": start.step if start else None, "notes": notes,
                        "aside": sorted(os.listdir(os.path.join(output_dir, "checkpoints", "damaged")))})  # fmt: skip
    torch.save(answers, out)


def main() -> None:
    from megarl.parallel.spawn import run_on_ranks

    hf_dir, mode, *rest = sys.argv[1:]
    if mode == "save":
        run_on_ranks(save, 1, hf_dir, rest[0], int(rest[1]), rest[2:])
    elif mode == "load":
        run_on_ranks(load, 1, hf_dir, rest[0], rest[1:])
    else:
        run_on_ranks(damaged, 1, hf_dir, rest[0], rest[1])


if __name__ == "__main__":
    main()
