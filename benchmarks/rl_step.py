"""One RL step (GRPO) of megarl vs a plain single-process transformers baseline, side by side in one run.

megarl: `megarl train`'s trainer on 2 spawned ranks (Megatron actor at TP=2, colocated vLLM engine at TP=2), its
per-phase times from metrics.jsonl. Baseline: one process with 2 threads (the same 2 cores), a transformers model:
HF ``generate`` (sampling, n samples per prompt), then one forward/backward of the same loss (GRPO advantages,
PPO-clipped token-mean with old = current log-probs) on the same number of sequences, and an Adam step.
Both: the same model, prompts, sampling and token budget; 1 warm-up step, then the median of the measured steps.

``--model DIR`` (an HF folder, e.g. ``.cache/smollm2-135m-instruct`` from ``megarl fetch-model``): that model at
``configs/demo_real.yaml``'s shape instead (8 prompts x 8 samples, 16 new tokens, DP=2 with one thread per rank,
dm_math prompts, fp32), the median of 6 steps after the warm-up: the first of them still grows each rank's heap
(a scratch count of one rank: 60,000 page faults and 14.6 s in its update, then ~500 and 11.4-11.5 s): six steps
make the median a steady step's even when one more of them is disturbed. It also prints the update's compute
floor: 6 x parameters (of the linear layers, the output layer's included) x the step's unpadded prompt + response
tokens, at the matmul rate measured in the same run (the model's own linear layers' forward, input-gradient and
weight-gradient GEMMs at one rank's share of the tokens, on as many processes as ranks at once, with the ranks'
threads), right after the side it bounds: this machine's speed drifts by ~10% within minutes. Both sides keep freed
host memory (``megarl.compat.host_memory``, ``trainer.keep_freed_memory``), so the comparison is of compute, not of
the page faults of whichever heap happens to shrink.

    python benchmarks/rl_step.py             # ~5 minutes here (tiny and ~24M-parameter models)
    python benchmarks/rl_step.py --model .cache/smollm2-135m-instruct      # ~6 minutes here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

MODELS = {
    "tiny (2x128)": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=256),
    "24M (8x512)": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, ffn_hidden_size=1408),
}
PHASES = ("generate", "reward", "old_logprob", "ref", "advantages", "update_actor", "sync", "step")


def _model_overrides(hf_dir: str, out_dir: str, args) -> list[str]:
    """The config as the benchmark runs it (``--model``: ``configs/demo_real.yaml`` as it is): no validation, no
    checkpoint, no W&B."""
    return [
        f"model.path={hf_dir}",
        f"trainer.output_dir={out_dir}",
        f"trainer.total_steps={args.steps + 1}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "logging.wandb.mode=disabled",
        "logging.progress_bar=false",
    ]


def _overrides(hf_dir: str, out_dir: str, args) -> list[str]:
    """``configs/quickstart.yaml`` at the benchmark's shape."""
    return _model_overrides(hf_dir, out_dir, args) + [
        f"data.train_batch_size={args.prompts}",
        f"actor.global_batch_size={args.prompts * args.n}",
        f"rollout.sampling.n={args.n}",
        f"rollout.sampling.max_new_tokens={args.new_tokens}",
        f"rollout.max_model_len={args.new_tokens + 32}",
        f"actor.seq_length={args.new_tokens + 32}",
        "rollout.kv_cache_mb=64",
        "actor.max_tokens_per_micro_batch=4096",
        f"rollout.tp={args.rollout_tp}",
    ]


def _megarl_worker(config: str, hf_dir: str, out_dir: str, overrides: list[str]) -> None:
    from megarl.config import load_config, validate
    from megarl.models.source import model_source
    from megarl.run.train import train

    cfg = load_config(config, overrides)
    train(cfg, validate(cfg, world_size=2), model_source(hf_dir))


def run_megarl(hf_dir: str, args, config: str = "configs/quickstart.yaml", overrides=None) -> dict:
    from megarl.parallel.spawn import run_on_ranks

    with tempfile.TemporaryDirectory() as out:
        overrides = (overrides or _overrides)(hf_dir, out, args)
        run_on_ranks(_megarl_worker, 2, config, hf_dir, out, overrides)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]  # step 1: warm-up
    med = {p: statistics.median(r[f"timing/{p}"] for r in rows) for p in PHASES}
    med["tokens"] = statistics.median(
        r["response_length/mean"] * args.prompts * args.n for r in rows
    )  # generated tokens per step
    med["trained_tokens"] = statistics.median(r["perf/tokens_per_s"] * r["timing/step"] for r in rows)
    return med


def _prompt_ids(tok, data: str | None, max_prompt_length: int) -> list[list[int]]:
    """Prompt token ids: the digits task's raw text, or ``data``'s prompts as megarl tokenises them (chat)."""
    if data is None:
        from megarl.data.builtin import builtin_records

        return [
            tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in builtin_records("builtin:digits", "train")
        ]
    from megarl.data import PromptDataset

    dataset = PromptDataset.from_files([data], split="train", tokenizer=tok, prompt_key="prompt", answer_key="answer",
                                       max_prompt_length=max_prompt_length, on_overlong="drop")  # fmt: skip
    return [list(p.prompt_ids) for p in dataset.prompts]


def run_baseline(hf_dir: str, args, data: str | None = None, max_prompt_length: int = 0) -> dict:
    """The same step written plainly with transformers in one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.algos import aggregate, broadcast_to_tokens, grpo, ppo_policy_loss
    from megarl.compat.host_memory import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    all_prompts = _prompt_ids(tok, data, max_prompt_length)
    times = {"generate": [], "update_actor": [], "step": [], "tokens": [], "trained_tokens": []}
    for step in range(args.steps + 1):
        prompts = all_prompts[step * args.prompts :][: args.prompts]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=args.new_tokens, num_return_sequences=args.n, pad_token_id=pad,
            )  # fmt: skip
        t1 = time.perf_counter()
        response = out[:, width:]
        mask = torch.ones_like(response, dtype=torch.float32)
        eos = (response == tok.eos_token_id).float().cumsum(-1)
        mask = mask * ((eos - (response == tok.eos_token_id).float()) == 0).float()  # up to and including EOS
        scores = torch.rand(len(response))  # reward cost is the same negligible rule on both sides
        adv = broadcast_to_tokens(grpo(scores, torch.arange(len(response)) // args.n), mask)
        full_attn = torch.cat([attn.repeat_interleave(args.n, 0), mask.long()], dim=1)
        logits = model(input_ids=out, attention_mask=full_attn).logits[:, width - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        pg = ppo_policy_loss(logp, logp.detach(), adv, clip_low=0.2, clip_high=0.2, clip_c=3.0)
        loss = aggregate(pg["loss"], mask, "token-mean", global_tokens=int(mask.sum()), global_seqs=len(mask))
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        t2 = time.perf_counter()
        if step:
            times["generate"].append(t1 - t0)
            times["update_actor"].append(t2 - t1)
            times["step"].append(t2 - t0)
            times["tokens"].append(float(mask.sum()))
            times["trained_tokens"].append(float(mask.sum()) + args.n * sum(map(len, prompts)))
    return {k: statistics.median(v) for k, v in times.items()}


def _linear_gemm_seconds(hf_dir: str, tokens: int) -> list[float]:
    """On every rank at once (one thread each): the seconds of the forward, input-gradient and weight-gradient GEMMs
    of every linear layer of ``hf_dir``'s model (the output layer included) for ``tokens`` tokens, and the GEMMs'
    FLOPs; [seconds, flops] summed, the slowest rank's seconds."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.compat.host_memory import keep_freed_memory

    keep_freed_memory()  # the GEMMs' outputs reuse freed memory, as in the ranks: compute, not page faults
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    shapes: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shapes[tuple(module.weight.shape)] = shapes.get(tuple(module.weight.shape), 0) + 1
    seconds = flops = 0.0
    dist.barrier()
    for (out_f, in_f), count in shapes.items():
        w, x, dy = torch.randn(out_f, in_f), torch.randn(tokens, in_f), torch.randn(tokens, out_f)
        for a, b in ((x, w.t()), (dy, w), (dy.t(), x)):  # forward, input gradient, weight gradient
            a @ b
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
            seconds += count * min(times)
        flops += count * 6 * out_f * in_f * tokens
    slowest = torch.tensor([seconds])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [float(slowest), flops]


def update_floor(hf_dir: str, trained_tokens: float, ranks: int) -> dict:
    """The update's compute floor (see the module docstring): the matmul rate of the model's own linear layers,
    measured on ``ranks`` processes at once at one rank's share of the tokens, and 6 x parameters x tokens at it.
    The parameters are the linear layers' (the output layer's included; an untied input embedding is a lookup, not
    a GEMM): for a tied model such as SmolLM2 all but the norms' 35K."""
    from megarl.parallel.spawn import run_on_ranks

    share = int(trained_tokens / ranks)
    seconds, flops = run_on_ranks(_linear_gemm_seconds, ranks, hf_dir, share)
    rate = flops / seconds  # per rank
    params = flops / (6 * share)  # the GEMMs' FLOPs are 6 x parameters x tokens
    return {"rate": rate, "params": params, "floor_s": 6 * params * trained_tokens / (ranks * rate)}


def main_model(args) -> None:
    """``--model``: the demo's shape on a real model, megarl's phases beside the baseline's and the floor."""
    from megarl.config import load_config

    demo = load_config("configs/demo_real.yaml", [])  # the shape the baseline copies
    data, max_prompt_length = demo.data.train_files[0], demo.data.max_prompt_length
    args.prompts, args.n = demo.data.train_batch_size, demo.rollout.sampling.n
    args.new_tokens = demo.rollout.sampling.max_new_tokens
    print(f"GRPO step on {args.model}: configs/demo_real.yaml ({args.prompts} prompts x {args.n} samples x <= "
          f"{args.new_tokens} new tokens, {data}, DP=2, fp32); 2 CPU cores; median of {args.steps} steps after 1 "
          f"warm-up")  # fmt: skip
    from megarl.compat.host_memory import HUGE_PAGES_ENV

    os.environ.update(HUGE_PAGES_ENV)  # as `megarl train` starts its CPU ranks (and the baseline's children)
    m = run_megarl(args.model, args, "configs/demo_real.yaml", _model_overrides)
    # each side's floor is measured right after it: this machine's speed drifts by ~10% within minutes
    floor = update_floor(args.model, m["trained_tokens"], ranks=2)
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:  # a fresh process: torch reads HUGE_PAGES_ENV when it starts
        b = pool.apply(run_baseline, (args.model, args, data, max_prompt_length))
    b_floor = update_floor(args.model, b["trained_tokens"], ranks=2)
    print(
        f"{'side':<26}{'generate':>10}{'update':>10}{'other':>9}{'step':>9}{'tokens':>8}{'floor':>8}{'update/floor':>14}"
    )
    sides = (("megarl DP=2 + vLLM", m, floor["floor_s"]), ("HF generate + torch (2 thr)", b, b_floor["floor_s"]))
    for side, r, fl in sides:
        other = r["step"] - r["generate"] - r["update_actor"]
        print(f"{side:<26}{r['generate']:>9.2f}s{r['update_actor']:>9.2f}s{other:>8.2f}s{r['step']:>8.2f}s"
              f"{r['trained_tokens']:>8.0f}{fl:>7.2f}s{r['update_actor'] / fl:>13.2f}x")  # fmt: skip
    print(
        f"floor: 6 x {floor['params'] / 1e6:.1f}M parameters x the step's prompt + response tokens at "
        f"{floor['rate'] / 1e9:.1f} GFLOP/s per rank measured after megarl's run, {b_floor['rate'] / 1e9:.1f} after "
        f"the baseline's (this model's linear GEMMs, 2 ranks x 1 thread)"
    )
    print("megarl phases: " + ", ".join(f"{p} {m[p]:.2f}s" for p in PHASES if p != "step"))
    ratio = m["update_actor"] / b["update_actor"]
    print(
        f"update: megarl {m['update_actor']:.2f}s vs baseline {b['update_actor']:.2f}s ({ratio:.2f}x); "
        f"per token {m['update_actor'] / m['trained_tokens'] * 1e3:.2f} vs "
        f"{b['update_actor'] / b['trained_tokens'] * 1e3:.2f} ms"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, help="measured steps after one warm-up step (default 3; 6 with --model)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--rollout-tp", type=int, default=0, help="vLLM TP (0: the actor's, 2)")
    parser.add_argument("--model", help="an HF folder: that model at configs/demo_real.yaml's shape instead "
                        "(--prompts, --n and --new-tokens do not apply)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps is None:  # --model: the first step after the warm-up still grows each rank's heap (page faults)
        args.steps = 6 if args.model else 3
    if args.model:
        return main_model(args)
    from megarl.models.tiny import make_tiny_hf_model

    print(f"GRPO step: {args.prompts} prompts x {args.n} samples x <= {args.new_tokens} new tokens; 2 CPU cores; "
          f"median of {args.steps} steps after 1 warm-up")  # fmt: skip
    header = f"{'model':<14} {'side':<22} " + " ".join(f"{p:>12}" for p in ("generate", "update", "other", "step"))
    print(header + f" {'gen tok/s':>10} {'step ratio':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            hf = make_tiny_hf_model(os.path.join(tmp, name.split()[0]), "llama", init_std=0.05, **MODELS[name])
            m = run_megarl(hf, args)
            b = run_baseline(hf, args)
            for side, r in (("megarl TP=2 + vLLM", m), ("HF generate + torch", b)):
                other = r["step"] - r["generate"] - r["update_actor"]
                cells = (r["generate"], r["update_actor"], other, r["step"])
                ratio = f"{b['step'] / m['step']:.2f}x" if side.startswith("megarl") else "1.00x"
                print(f"{name:<14} {side:<22} " + " ".join(f"{c:>11.3f}s" for c in cells)
                      + f" {r['tokens'] / r['generate']:>10.0f} {ratio:>10}", flush=True)  # fmt: skip
            print(f"{'':<14} megarl phases: " + ", ".join(f"{p} {m[p]:.3f}s" for p in PHASES if p != "step"))


if __name__ == "__main__":
    main()
