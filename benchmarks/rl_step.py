"""One RL step (GRPO) of megarl vs a plain single-process transformers baseline, side by side in one run.

megarl: `megarl train`'s trainer on 2 spawned ranks (Megatron actor at TP=2, colocated vLLM engine at TP=2), its
per-phase times from metrics.jsonl. Baseline: one process with 2 threads (the same 2 cores), a transformers model:
HF ``generate`` (sampling, n samples per prompt), then one forward/backward of the same loss (GRPO advantages,
PPO-clipped token-mean with old = current log-probs) on the same number of sequences, and an Adam step.
Both: the same model, prompts, sampling and token budget; 1 warm-up step, then the median of the measured steps.

    python benchmarks/rl_step.py             # ~5 minutes here (tiny and ~24M-parameter models)
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


def _overrides(hf_dir: str, out_dir: str, args) -> list[str]:
    return [
        f"model.path={hf_dir}",
        f"trainer.output_dir={out_dir}",
        f"trainer.total_steps={args.steps + 1}",
        "trainer.val_every=0",
        "logging.wandb.mode=disabled",
        "logging.progress_bar=false",
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


def _megarl_worker(hf_dir: str, out_dir: str, overrides: list[str]) -> None:
    from megarl.config import load_config, validate
    from megarl.trainer.loop import train
    from megarl.training.init_weights import model_source

    cfg = load_config("configs/quickstart.yaml", overrides)
    train(cfg, validate(cfg, world_size=2), model_source(hf_dir))


def run_megarl(hf_dir: str, args) -> dict:
    from megarl.parallel.spawn import run_on_ranks

    with tempfile.TemporaryDirectory() as out:
        run_on_ranks(_megarl_worker, 2, hf_dir, out, _overrides(hf_dir, out, args))
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]  # step 1: warm-up
    med = {p: statistics.median(r[f"timing/{p}"] for r in rows) for p in PHASES}
    med["tokens"] = statistics.median(
        r["response_length/mean"] * args.prompts * args.n for r in rows
    )  # generated tokens per step
    return med


def run_baseline(hf_dir: str, args) -> dict:
    """The same step written plainly with transformers in one process."""
    from transformers import AutoModelForCausalLM

    from megarl.algos import aggregate, broadcast_to_tokens, grpo, ppo_policy_loss
    from megarl.data.builtin import builtin_records

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    records = builtin_records("builtin:digits", "train")
    times = {"generate": [], "update_actor": [], "step": [], "tokens": []}
    for step in range(args.steps + 1):
        prompts = [
            tok(r["prompt"], add_special_tokens=False)["input_ids"]
            for r in records[step * args.prompts :][: args.prompts]
        ]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])  # left padding
        attn = (ids != tok.pad_token_id).long()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=args.new_tokens, num_return_sequences=args.n, pad_token_id=tok.pad_token_id,
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
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--rollout-tp", type=int, default=0, help="vLLM TP (0: the actor's, 2)")
    args = parser.parse_args(argv)
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
