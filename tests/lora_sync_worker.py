"""Runs inside each spawned rank: a Megatron actor with LoRA adapters and a colocated vLLM engine with LoRA slots
(CPU build). Records what the engine computes after each sync, beside the actor's own log-probabilities."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megarl import lifetime
from megarl.backend.logprobs import token_logprobs
from megarl.backend.setup import wrap_for_training
from megarl.backend.step import lm_loss, make_lm_micro_batches, train_step
from megarl.config.schema import LoraConfig, OptimConfig
from megarl.convert.hf_to_megatron import load_hf_into_chunk
from megarl.lora import adapters_off, apply_lora
from megarl.lora.adapters import hf_shape, peft_key
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.builder import build_model_chunk
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.reshard.executor import ReshardVerificationError
from megarl.reshard.layout import megatron_adapter_layout, megatron_layout
from megarl.reshard.sync import actor_tensors, push_actor
from megarl.rollout.protocol import EngineUnhealthyError
from megarl.rollout.vllm_engine import VLLMEngine
from tests.vllm_sync_worker import GEN, ROLLOUT, _everyone


def random_adapter(spec, lora: LoraConfig, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named factors with B != 0 (a fresh adapter has B = 0 and changes nothing), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(spec.num_layers):
        for t in lora.target_modules:
            out_f, in_f = hf_shape(spec, t)
            out[peft_key(layer, t, "A")] = torch.randn(lora.rank, in_f, generator=gen) / in_f**0.5
            out[peft_key(layer, t, "B")] = torch.randn(out_f, lora.rank, generator=gen) * 0.05
    return out


def run_lora_sync(
    hf_dir: str, megatron: tuple[int, int, int], vllm_tp: int, lora: LoraConfig, transport: str, seq, prompt
) -> dict:
    """``transport``: how the base enters the engine (the first sync; vLLM's full reload resets its LoRA state)."""
    tp, pp, dp = megatron
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    init_distributed(layout, seed=7)
    rank, world = dist.get_rank(), dist.get_world_size()
    c = layout.coords(rank)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    chunk = build_model_chunk(spec, layout, init_weights=False)
    load_hf_into_chunk(chunk, hf_dir, spec, layout, rank, progress=False)
    apply_lora(chunk, spec, lora, c.tp, tp, full=random_adapter(spec, lora, seed=5), seed=0)
    ddp, optimizer = wrap_for_training(chunk, OptimConfig(optimizer="adam", lr=2e-2, clip_grad=0.0))
    engine = VLLMEngine(
        ROLLOUT, hf_dir, spec, megatron_layout(spec, layout, world), tp=vllm_tp, seed=0, lora=lora,
        adapter_layout=megatron_adapter_layout(spec, lora, layout, world),
    )  # fmt: skip
    engine.transport = transport

    def actor(ids: list[int]) -> list[float]:
        return token_logprobs(ddp, torch.tensor([ids]), temperature=1.0, true_vocab=spec.vocab_size)[0].tolist()

    def observe(report) -> dict:
        samples, _ = engine.generate([prompt], [0], [1234], GEN)
        s = samples[0]
        return {
            "score": _everyone(engine.score(seq)),
            "actor": actor(seq),
            "generated": _everyone((s.token_ids, s.logprobs)),
            "actor_generated": actor(prompt + s.token_ids)[len(prompt) - 1 :],
            "report": _everyone(report),
            "adapter": _everyone(engine.adapters.request.lora_int_id if engine.adapters else None),
        }

    out = {"max_lora_rank": engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank}
    with adapters_off(ddp.module):
        out["base"] = actor(seq)
    steps = [observe(push_actor(engine, ddp, 0))]  # the base, then the adapters
    for update in (1, 2):  # real updates of the adapters (the base stays frozen): only they move
        gen = torch.Generator().manual_seed(100 * update + c.dp)
        train_step(ddp, optimizer, make_lm_micro_batches(torch.randint(3, 259, (2, 33), generator=gen), 1), lm_loss)
        steps.append(observe(push_actor(engine, ddp, update)))
    out["steps"] = steps
    adapter_dir = engine.adapters.directory
    out["adapter_dirs"] = _everyone(sorted(os.listdir(adapter_dir)))
    out["adapter_dir_is_the_runs"] = adapter_dir.startswith(os.path.join(lifetime.SHM_DIR, lifetime.shm_prefix()))

    def corrupt(t, piece):
        if "lora_B" in t.hf:
            piece.view(-1)[0] += 1.0

    try:
        engine.update_weights(actor_tensors(ddp, merge_lora=False), 3, on_send=corrupt)
        out["corrupt"] = None
    except ReshardVerificationError as e:
        out["corrupt"] = str(e)
    try:
        engine.score(seq)
        out["refused_after_corrupt"] = False
    except EngineUnhealthyError:
        out["refused_after_corrupt"] = True
    if rank == 1:  # one rank cannot load its copy (say /dev/shm is full): every rank stops, nothing is left behind
        engine.adapters._add = lambda path, tensors: (_ for _ in ()).throw(OSError("No space left on device"))
    try:
        push_actor(engine, ddp, 4)
        out["one_rank_failed"] = None
    except (OSError, RuntimeError) as e:
        out["one_rank_failed"] = _everyone((str(e), engine.healthy, sorted(os.listdir(adapter_dir))))
    engine.adapters.__dict__.pop("_add", None)
    out["recovered"] = observe(push_actor(engine, ddp, 5))

    # merge mode (rollout.lora_merge): the trainer merges the adapters and the engine gets whole weights, generating
    # without an adapter. Production starts vLLM without LoRA slots for it (the e2e job grpo_lora_merge); here the
    # same engine's slots are left unused, so one engine serves both modes.
    engine.adapters.remove()
    engine.adapters, engine.base_loaded = None, False
    out["merged"] = observe(push_actor(engine, ddp, 6))
    return out
