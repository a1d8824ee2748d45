"""The actor's update step: megarl against a plain transformers step, same model, tokens and optimizer, one run.

megarl: ``megarl.backend.step.train_step`` (what the trainer's actor update calls) with the trainer's actor loss
(``megarl.backend.losses.actor_loss``: GRPO/PPO's clipped token-mean, on-policy, its entropy metric included), on a
Megatron chunk with the local spec, once per core attention (``model.attention``: ``sdpa``, ``unfused``). Baseline:
``AutoModelForCausalLM`` with ``attn_implementation="sdpa"``, the same PPO loss on ``log_softmax`` of its logits,
``torch.optim.AdamW`` (fused on CUDA, its default foreach implementation on CPU), gradient clipping at 1.0. Both:
the same weights (one HF folder), tokens, advantages, micro-batches and gradient accumulation; freed host memory
kept on CPU (``megarl.compat.host_memory``, as in a CPU rank); dtype policy fp32 on CPU; on CUDA fp32 master
weights with bf16 compute (megarl: bf16 parameters + Megatron's fp32 main parameters; HF: fp32 parameters under
bf16 autocast). All variants live at once and take their steps in turn (round robin, so a
drift of the machine's speed hits each alike); medians of ``--steps`` steps each after ``--warmup`` steps,
CUDA-synchronised. A variant's peak GPU memory is its own state plus the most its step allocated on top.

MFU counts 6 x parameters x tokens plus causal attention's 6 x layers x seq x heads x head_dim x tokens (the
convention of ../shared/facts/gpu-h100-first-contact.md) against the GPU's dense bf16 peak.

    python benchmarks/train_step.py            # CPU: a 34M-parameter Llama, 8 x 256 tokens (~3 minutes here)
    python benchmarks/train_step.py --json     # the same rows as a JSON list
    python benchmarks/train_step.py --without-compat   # also megarl-sdpa without megarl's Megatron speed-ups
    python benchmarks/train_step.py --prompt 48 --length 64 --sequences 32 --micro 32   # a prompt the loss skips
    python benchmarks/train_step.py --model .cache/smollm2-135m-instruct ...   # a real model's weights and shape
    python benchmarks/train_step.py            # CUDA: configs/models/llama-1.2b, 16 x 2048 tokens, bf16
    python benchmarks/train_step.py --host --without-compat   # CPU: what issuing the 1.2B's step costs the host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, ffn_hidden_size=1536, vocab_size=8192)
CUDA_MODEL = dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, ffn_hidden_size=5632, vocab_size=32000)
"""configs/models/llama-1.2b/config.json"""
HOST_MODEL = dict(CUDA_MODEL, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=512)
"""``--host``: the 1.2B's layers, heads and micro-batches on tensors too small to compute: a step's time is what the
host spends issuing it (Python, the dispatcher), which a GPU step pays before its kernels can run."""
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 peak per GPU model name."""
LR = 1e-5
VARIANTS = ("megarl-sdpa", "megarl-sdpa-compiled", "megarl-sdpa-all-logits", "megarl-sdpa-nocompat", "megarl-unfused",
            "hf")
"""In the order of the table (the second on CPU only, without --host: ``model.compile_elementwise``; the third and
fourth only with --prompt, --without-compat)."""


def _peak_tflops() -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _flops_per_step(shape: dict, params: int, tokens: int, length: int) -> float:
    attention = 6 * shape["num_layers"] * length * shape["hidden_size"] * tokens  # causal: half of 12 L s h
    return 6 * params * tokens + attention


def _batch(vocab: int, sequences: int, length: int, prompt: int = 0) -> tuple[torch.Tensor, ...]:
    """Random training sequences [n, length + 1], one advantage per sequence broadcast to its tokens, and the loss
    mask [n, length]: the positions that score a response token (all of them when ``prompt`` is 0; otherwise
    from position ``prompt - 1`` on, as ``megarl.backend.batch.collate`` lays out a prompt of that length)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (sequences, length + 1), generator=gen)
    advantages = torch.randn(sequences, 1, generator=gen).expand(sequences, length).contiguous()
    mask = torch.ones(sequences, length)
    mask[:, : max(prompt - 1, 0)] = 0
    return tokens, advantages, mask


class Variant:
    """One side of the comparison: its step, and what it holds on the GPU between steps."""

    def __init__(self, name: str, build, cuda: bool):
        before = torch.cuda.memory_allocated() if cuda else 0
        self.name, self.cuda = name, cuda
        self.step, self.params = build()
        self.first_grad_norm = self.step()  # warm-up; the optimizer's state exists from here on
        self.held = (torch.cuda.memory_allocated() - before) if cuda else 0
        self.times: list[float] = []
        self.peak = 0

    def timed_step(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        self.step()
        if self.cuda:
            torch.cuda.synchronize()
            # the others' state is allocated too: this variant's own peak is its state plus what its step added
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() - base + self.held)
        self.times.append(time.perf_counter() - t0)


def _megatron_glu(model) -> bool:
    """Stands in for ``batch_major_logits`` (Megatron's own output layer) and puts the MLPs back on Megatron's own
    GLU (``silu(gate) * (up + 0)``) instead of ``megarl.models.swiglu``."""
    model.config.use_te_activation_func = False
    return False


@contextlib.contextmanager
def megatron_speed_off():
    """Within the block, models are built and stepped as megatron-core does without ``megarl.compat.megatron_speed``
    and ``megarl.models.swiglu``: its own RoPE, output layer, GLU, torch's RMSNorm, weight-gradient accumulation,
    TP mappings, linear layers' function, gradient clipping and torch's default Adam. (A model built here keeps its
    GLU, its norms and its unfused gradients after the block.)"""
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mixed
    from megatron.core.tensor_parallel import layers

    import megarl.backend.setup as setup
    import megarl.models.builder as builder

    kept = (rope_utils._apply_rotary_pos_emb_bshd, builder.rope_in_four_ops, builder.batch_major_logits,
            builder.rms_norm_on_cpu, setup.weight_gradients_into_main_grad, setup.multi_tensor_fallbacks_in_place,
            setup.fused_adam, clip_grads.multi_tensor_scale_impl, clip_grads.l2_norm_impl,
            builder.no_tp_mappings_on_one_rank, layers.copy_to_tensor_model_parallel_region,
            layers.reduce_from_tensor_model_parallel_region, mixed.multi_tensor_scale_impl,
            builder.linear_without_communication, layers.linear_with_grad_accumulation_and_async_allreduce)  # fmt: skip
    rope_utils._apply_rotary_pos_emb_bshd = getattr(kept[0], "original", kept[0])
    builder.rope_in_four_ops = lambda: False  # a model built in the block would patch RoPE again
    builder.no_tp_mappings_on_one_rank = lambda: False  # and the TP mappings
    layers.copy_to_tensor_model_parallel_region = getattr(kept[10], "original", kept[10])
    layers.reduce_from_tensor_model_parallel_region = getattr(kept[11], "original", kept[11])
    builder.linear_without_communication = lambda: False  # and the linear layers' function
    layers.linear_with_grad_accumulation_and_async_allreduce = getattr(kept[14], "original", kept[14])
    builder.batch_major_logits, builder.rms_norm_on_cpu = _megatron_glu, (lambda model, compiled=False: 0)
    setup.weight_gradients_into_main_grad, setup.multi_tensor_fallbacks_in_place = (lambda model: 0), (lambda: False)
    setup.fused_adam = lambda optimizer: 0
    clip_grads.multi_tensor_scale_impl = mixed.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    try:
        yield
    finally:
        (rope_utils._apply_rotary_pos_emb_bshd, builder.rope_in_four_ops, builder.batch_major_logits,
         builder.rms_norm_on_cpu, setup.weight_gradients_into_main_grad, setup.multi_tensor_fallbacks_in_place,
         setup.fused_adam, clip_grads.multi_tensor_scale_impl, clip_grads.l2_norm_impl,
         builder.no_tp_mappings_on_one_rank, layers.copy_to_tensor_model_parallel_region,
         layers.reduce_from_tensor_model_parallel_region, mixed.multi_tensor_scale_impl,
         builder.linear_without_communication,
         layers.linear_with_grad_accumulation_and_async_allreduce) = kept  # fmt: skip


def without_compat(build):
    """``build``'s megarl step as megatron-core computes it without megarl's speed-ups (``megatron_speed_off``)."""
    with megatron_speed_off():
        inner, params = build()

    def step() -> float:
        with megatron_speed_off():
            return inner()

    return step, params


def megarl_actor(hf_dir: str, attention: str, dtype: str, sequences: int, length: int, micro: int, prompt: int = 0,
                 all_logits: bool = False, compile_elementwise: bool = False):
    """The actor as the trainer builds it, on the HF folder's weights (world 1, TP=PP=1), and its update's inputs:
    ``(model, optimizer, micro_batches, loss_fn, parameter count)`` for ``sequences`` x ``length`` random tokens in
    micro-batches of ``micro`` (the first ``prompt`` tokens of each a prompt the loss does not score).
    ``all_logits``: the output layer computes the prompt positions' logits too (``scored_from`` 0).
    ``compile_elementwise``: ``model.compile_elementwise``."""
    from megarl.backend.init_weights import load_initial_weights
    from megarl.backend.losses import GlobalNorm, actor_loss
    from megarl.backend.setup import wrap_for_training
    from megarl.config.schema import ActorConfig, AlgorithmConfig, OptimConfig
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.builder import build_model_chunk
    from megarl.models.source import model_source
    from megarl.parallel.layout import ParallelLayout

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    layout = ParallelLayout()
    chunk = build_model_chunk(spec, layout, dtype=dtype, init_weights=False, attention=attention,
                              compile_elementwise=compile_elementwise)
    load_initial_weights(chunk, model_source(hf_dir), spec, layout, 0)
    model, optimizer = wrap_for_training(chunk, OptimConfig(optimizer="adam", lr=LR, clip_grad=1.0))
    tokens, advantages, mask = _batch(spec.vocab_size, sequences, length, prompt)
    batches = []
    for i in range(0, sequences, micro):
        ids, rows = tokens[i : i + micro], len(tokens[i : i + micro])
        batches.append({"tokens": ids[:, :-1].contiguous(), "targets": ids[:, 1:].contiguous(),
                        "position_ids": torch.arange(length).expand(rows, -1).contiguous(),
                        "loss_mask": mask[i : i + micro], "advantages": advantages[i : i + micro],
                        "rollout_logp": torch.zeros(rows, length),
                        "scored_from": 0 if all_logits else max(prompt - 1, 0)})  # fmt: skip
    norm = GlobalNorm(tokens=int(mask.sum()), seqs=sequences, norm_len=length, scale=len(batches))
    loss = actor_loss(ActorConfig(), AlgorithmConfig(adv_estimator="grpo"), norm, temperature=1.0,
                      true_vocab=spec.vocab_size)  # fmt: skip
    return model, optimizer, batches, loss, sum(p.numel() for p in chunk.parameters())


def megarl_step(hf_dir: str, attention: str, dtype: str, sequences: int, length: int, micro: int, prompt: int = 0,
                all_logits: bool = False, compile_elementwise: bool = False):
    """The actor's update as the trainer runs it (``megarl_actor``'s arguments): a callable taking one optimizer
    step and returning its gradient norm; and the parameter count."""
    from megarl.backend.step import SUM, train_step

    model, optimizer, batches, loss, params = megarl_actor(hf_dir, attention, dtype, sequences, length, micro, prompt,
                                                           all_logits, compile_elementwise)  # fmt: skip

    def step() -> float:
        return train_step(model, optimizer, batches, loss, reduce=SUM)["grad_norm"]

    return step, params


def hf_step(hf_dir: str, args, cuda: bool):
    """The plain transformers step on the same weights, tokens and micro-batches: (step, parameter count)."""
    from transformers import AutoModelForCausalLM

    from megarl.algos import aggregate, ppo_policy_loss

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8, fused=cuda or None)
    tokens, advantages, mask = _batch(args.shape["vocab_size"], args.sequences, args.length, args.prompt)
    n = args.sequences
    params = sum(p.numel() for p in model.parameters())

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        for i in range(0, n, args.micro):
            ids = tokens[i : i + args.micro].to(device, non_blocking=True)
            adv = advantages[i : i + args.micro].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda or args.host):
                logits = model(input_ids=ids[:, :-1]).logits
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            pg = ppo_policy_loss(logp, logp.detach(), adv, clip_low=0.2, clip_high=0.2, clip_c=3.0)
            aggregate(pg["loss"], mask[i : i + args.micro].to(device), "token-mean", global_tokens=int(mask.sum()),
                      global_seqs=n).backward()  # fmt: skip
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(grad_norm)

    return step, params


def _paired(v: Variant, hf: Variant) -> tuple[float, float, float]:
    """The median and quartiles of this variant's step time over the hf step's of the same round (the machine's speed
    drifts: a pair of neighbouring steps shares it)."""
    ratios = [a / b for a, b in zip(v.times, hf.times)]
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), low, high


def _row(v: Variant, args, hf: Variant) -> dict:
    step_s, params = statistics.median(v.times), v.params
    tokens = args.sequences * args.length
    tflops = _peak_tflops()
    flops = _flops_per_step(args.shape, params, tokens, args.length)
    return {
        "name": v.name,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "mfu": flops / step_s / (tflops * 1e12) if tflops else None,
        "peak_gb": v.peak / 1e9 if v.cuda else None,
        "grad_norm_first_step": v.first_grad_norm,
        "vs_hf_paired": _paired(v, hf),
        "params": params,
        "steps": len(v.times),
    }


def measure(hf_dir: str, args) -> list[dict]:
    """Rank 0 of a world of 1 (Megatron needs its process groups): every variant in turn on this device."""
    from megarl.compat.host_memory import keep_freed_memory
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    torch.set_num_threads(args.threads)  # both sides get the same cores
    cuda = torch.cuda.is_available()
    if not cuda:  # as a CPU rank does (trainer.keep_freed_memory): compute, not page faults
        keep_freed_memory()
    init_distributed(ParallelLayout(), seed=1)
    dtype = "bfloat16" if cuda or args.host else "float32"  # --host: the GPU's dtype policy, its ops
    shape = (args.sequences, args.length, args.micro, args.prompt)
    builds = {f"megarl-{a}": lambda a=a: megarl_step(hf_dir, a, dtype, *shape) for a in ("sdpa", "unfused")}
    if not (cuda or args.host):  # model.compile_elementwise: CPU only; --host measures the GPU's issuing
        builds["megarl-sdpa-compiled"] = lambda: megarl_step(hf_dir, "sdpa", dtype, *shape, compile_elementwise=True)
    if args.without_compat:
        builds["megarl-sdpa-nocompat"] = lambda: without_compat(lambda: megarl_step(hf_dir, "sdpa", dtype, *shape))
    if args.prompt:  # the same step with the prompt positions' logits computed (as before logits_from)
        builds["megarl-sdpa-all-logits"] = lambda: megarl_step(hf_dir, "sdpa", dtype, *shape, all_logits=True)
    builds["hf"] = lambda: hf_step(hf_dir, args, cuda)
    variants = [Variant(name, builds[name], cuda) for name in VARIANTS if name in builds and name not in args.skip]
    for _ in range(args.warmup - 1):
        for v in variants:
            v.step()
    for _ in range(args.steps):  # round robin: a drift of the machine's speed hits every variant alike
        for v in variants:
            v.timed_step()
    return [_row(v, args, variants[-1]) for v in variants]  # hf is last


def table(rows: list[dict], args, device: str) -> str:
    hf = next(r for r in rows if r["name"] == "hf")
    lines = [
        f"actor update step on {device}: {args.sequences} x {args.length} tokens"
        f"{f' (the first {args.prompt} a prompt)' if args.prompt else ''}, micro-batches of {args.micro}, "
        f"{rows[0]['params'] / 1e6:.1f}M parameters; median of {args.steps} steps after {args.warmup} warm-up",
        f"{'variant':<22}{'s/step':>9}{'tokens/s':>11}{'MFU':>8}{'peak GB':>9}{'vs hf':>8}{'per round (IQR)':>24}"
        f"{'grad norm (1st)':>17}",
    ]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        paired = "{:.3f}x ({:.3f}-{:.3f})".format(*r["vs_hf_paired"])
        lines.append(f"{r['name']:<22}{r['step_s']:>9.3f}{r['tokens_per_s']:>11.0f}{mfu:>8}{peak:>9}"
                     f"{r['step_s'] / hf['step_s']:>7.2f}x{paired:>24}{r['grad_norm_first_step']:>17.4f}")  # fmt: skip
    lines.append("per round: the median of each step's time over the hf step's in the same round, and its quartiles")
    return "\n".join(lines)


def _shape(hf_dir: str) -> dict:
    """The shape keys this benchmark uses, from an HF folder's config.json."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    return dict(hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                vocab_size=config["vocab_size"])  # fmt: skip


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16 if cuda else 8)
    parser.add_argument("--length", type=int, default=2048 if cuda else 256, help="tokens per sequence")
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (both sides)")
    parser.add_argument("--prompt", type=int, default=0,
                        help="tokens of each sequence that are prompt (not scored): adds megarl-sdpa-all-logits")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--skip", default=[], type=lambda names: names.split(","),
                        help="comma-separated variants to leave out (not hf), e.g. megarl-unfused where all of them "
                             "at once would not fit the GPU's memory")  # fmt: skip
    parser.add_argument("--without-compat", action="store_true",
                        help="also megarl-sdpa without megarl.compat.megatron_speed, megarl.models.swiglu")  # fmt: skip
    parser.add_argument("--model", help="an HF folder (e.g. .cache/smollm2-135m-instruct) instead of the random one")
    parser.add_argument("--host", action="store_true",
                        help="the host's cost of a step on CPU: the 1.2B's 16 layers and 8 micro-batches of 2 "
                             "sequences at width 64 and 16 tokens, one thread, the GPU's dtype policy")  # fmt: skip
    args = parser.parse_args(argv)
    if args.host and (cuda or args.model):
        parser.error("--host measures the host's cost on a CPU machine, with its own model: without CUDA and --model")
    unknown = set(args.skip) - set(VARIANTS) | ({"hf"} & set(args.skip))
    if unknown:
        parser.error(f"--skip: {', '.join(sorted(unknown))} not among {', '.join(VARIANTS[:-1])}")
    args.shape = _shape(args.model) if args.model else CUDA_MODEL if cuda else CPU_MODEL
    if args.host:
        args.shape, args.sequences, args.length, args.micro, args.threads = HOST_MODEL, 16, 16, 2, 1
    sys.path.insert(0, REPO)
    from megarl.models.tiny import make_tiny_hf_model
    from megarl.parallel.spawn import run_on_ranks

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.model or make_tiny_hf_model(os.path.join(tmp, "model"), "llama",
                                                  max_position_embeddings=args.length, **args.shape)  # fmt: skip
        rows = run_on_ranks(measure, 1, hf_dir, args)
    device = torch.cuda.get_device_name() if cuda else f"CPU ({args.threads} threads)"
    print(json.dumps(rows) if args.json else table(rows, args, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
