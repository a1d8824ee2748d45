"""Runs inside every spawned rank of the placement guard (``MEGARL_FAKE_DEVICE=meta``: "the GPU" is the meta device):
builds every role of an RL job as the trainer does and reports, per model, where each tensor lives and its dtype."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.backend.models import build_rl_models
from megarl.backend.offload import grad_buffers
from megarl.config.loader import load_config
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.source import model_source
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and tensor held as a plain module attribute (RoPE's ``inv_freq``), by name."""
    out = {f"param {n}": p for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b for n, b in model.named_buffers()})
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                out[f"attribute {prefix}.{name}"] = value
    return out


def _optimizer_tensors(optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"main param {i}.{g}.{j}"] = p
    return out


def report(models) -> dict:
    """role -> {name: (device type, dtype)} of everything the role's model (and its optimizer) holds."""
    roles = {}
    for role in ("actor", "critic", "reference", "reward_model"):
        model = getattr(models, role)
        if model is None:
            continue
        held = tensors(model)
        if role in ("actor", "critic"):  # trained: Megatron DDP's gradient buffers
            held.update({f"grad buffer {i}": b for i, b in enumerate(grad_buffers(model))})
        optim = getattr(models, f"{role}_optim", None)
        if optim is not None:
            held.update(_optimizer_tensors(optim))
        roles[role] = {n: (t.device.type, str(t.dtype).removeprefix("torch.")) for n, t in held.items()}
    return roles


def run_placement(hf_dir: str, rm_dir: str, dtypes: list[str]) -> dict:
    """Per dtype: PPO (actor, critic, reference, reward model), then a LoRA actor with a critic, at TP=2 x PP=2."""
    layout = ParallelLayout(tp=2, pp=2)
    init_distributed(layout, seed=1)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    common = [f"model.path={hf_dir}", "actor.parallel.tp=2", "actor.parallel.pp=2",
              "algorithm.adv_estimator=gae", "actor.kl_loss_coef=0.1", f"reward.model.path={rm_dir}"]  # fmt: skip
    out = {}
    for dtype in dtypes:
        out[dtype] = {}
        for case, extra in (("ppo", []), ("lora", ["actor.lora.rank=4"])):
            cfg = load_config(None, [*common, f"model.dtype={dtype}", *extra])
            models = build_rl_models(cfg, spec, layout, model_source(hf_dir), dist.get_rank())
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, report(models))
            out[dtype][case] = per_rank
    return out
