"""Runs inside each spawned rank: a job built as ``megarl train`` builds it (``build_job``), its rollout engine a
fake that records the training state resident on the rank when the engine is built and at the first sync."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megarl.reshard.sync import SyncReport
from tests.rl_update_worker import _storage_bytes


def _resident_bytes(models) -> int:
    """Bytes of the distinct, non-empty storages of every model's parameters, gradient buffers and optimizer
    (its parameter groups, i.e. fp32 main parameters, and its state): walked here, not taken from the planner."""
    tensors = []
    for role in ("actor", "critic", "reference", "reward_model"):
        model = getattr(models, role)
        if model is None:
            continue
        tensors += list(model.parameters())
        if hasattr(model, "ddp_config"):  # trained: Megatron DDP's gradient buffers
            tensors += [b.grad_data for b in model.buffers]
        optim = getattr(models, f"{role}_optim", None)
        for opt in getattr(optim, "chained_optimizers", [optim] if optim is not None else []):
            tensors += [p for group in opt.optimizer.param_groups for p in group["params"]]
            tensors += [v for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return _storage_bytes(tensors)


class RecordingEngine:
    """What ``build_job`` asks of a rollout engine, recording the resident training bytes at build and first sync."""

    adapter_slots, lora, tp, weight_version = False, None, 1, None

    def __init__(self, models):
        self.models = models
        self.at = {"built": _resident_bytes(models)}

    def update_weights(self, tensors, version: int, *, resend_base: bool = False) -> SyncReport:
        self.at.setdefault("first sync", _resident_bytes(self.models))
        self.weight_version = version
        return SyncReport(transport="recorded")


def run_startup(overrides: list[str]) -> dict:
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.models.source import model_source
    from megarl.run import job as job_module

    cfg = load_config(None, overrides)
    spec = validate(cfg)
    built = {}

    def start_engine(cfg, spec, source, layout, place):
        built["engine"] = RecordingEngine(built["models"])
        return built["engine"]

    build_rl_models = job_module.build_rl_models

    def keep_models(*args, **kwargs):
        built["models"] = build_rl_models(*args, **kwargs)
        return built["models"]

    job_module.start_engine, job_module.build_rl_models = start_engine, keep_models
    job, _ = job_module.build_job(cfg, spec, model_source(cfg.model.path))
    with job.rewards if job.rewards is not None else contextlib.nullcontext(), job.tracker:
        pass  # closed as a run closes them

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, built["engine"].at)
    return {"per_rank": everyone}
