"""Generation engines behind one protocol (``protocol.py``): vLLM colocated in the torchrun ranks, and HF generate."""

from __future__ import annotations

import json
import os

from megarl.config.schema import MegarlConfig
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.pools import Placement
from megarl.reshard.layout import megatron_adapter_layout, megatron_layout


def write_engine_dir(hf_config: dict, tokenizer_dir: str, out_dir: str) -> str:
    """The directory an engine starts from: the actor's HF config and tokenizer, no weights (they arrive through the
    resharding engine). ``hf_config`` comes from the checkpoint's metadata or the HF model's config.json."""
    from megarl.convert.hf_io import copy_tokenizer_files

    os.makedirs(out_dir, exist_ok=True)
    if not copy_tokenizer_files(tokenizer_dir, out_dir):
        raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir}")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    return out_dir


def build_engine(
    cfg: MegarlConfig,
    spec: ModelSpec,
    layout: ParallelLayout,
    engine_dir: str,
    *,
    gpus_per_node: int,
    seed: int = 0,
    place: Placement | None = None,
):
    """The configured engine (collective: every rank of the rollout's pool builds its part), fed by the actor at
    ``layout``. Call ``config.validate`` first. ``place``: resource pools; a rank outside the rollout pool gets a
    ``RemoteEngine`` (it sends the weights the engines receive).

    The engines are imported here, when one is built: vLLM only on the rollout's ranks, and this package's protocol
    and stream (imported from the resharding engine below it) stay free of what the engines import."""
    from megarl.config.validate import adapter_slots, rollout_tp

    place = place or Placement.colocated()
    actor_start, rollout = place.ranks("actor").start, place.ranks("rollout")
    src_layout = megatron_layout(spec, layout, gpus_per_node=gpus_per_node).shifted(actor_start)
    if cfg.rollout.backend == "hf":
        from megarl.rollout.hf_engine import HFEngine

        return HFEngine(cfg.rollout, engine_dir, spec, src_layout, dtype=cfg.model.dtype)
    lora = cfg.actor.lora if adapter_slots(cfg) else None  # into vLLM's LoRA slots
    adapter_src = (
        None if lora is None else megatron_adapter_layout(spec, lora, layout, gpus_per_node).shifted(actor_start)
    )
    tp, comm = rollout_tp(cfg), place.comm if place.pooled else None
    if not place.hosts("rollout"):
        from megarl.reshard.sync import SyncPlans
        from megarl.rollout.remote import RemoteEngine

        plans = SyncPlans(
            spec, src_layout, tp=tp, world=len(rollout), offset=rollout.start, lora=lora, adapter_src=adapter_src
        )
        return RemoteEngine(cfg.rollout, plans, tp=tp, dtype=cfg.model.dtype, comm=comm, lora=lora)
    from megarl.rollout.vllm_engine import VLLMEngine

    with place.engine_env():
        return VLLMEngine(
            cfg.rollout, engine_dir, spec, src_layout, tp=tp, dtype=cfg.model.dtype, seed=seed,
            collective_timeout_s=cfg.trainer.collective_timeout_s, lora=lora, adapter_layout=adapter_src,
            pool=place.pool.name if place.pooled else None, offset=rollout.start, comm=comm,
            record_routes=cfg.actor.moe_routing_replay != "off",
        )  # fmt: skip
