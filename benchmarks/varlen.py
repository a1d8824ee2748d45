"""Variable-length batches: one GRPO update on long-tailed response lengths, packed three ways, in one run.

The trainer's ``learn`` (old log-probs, then the actor's update: what a GRPO step computes after the rollout) on 2
ranks (DP=2, gloo, one thread each) over a tiny Llama, one fixed batch of ``--sequences`` sequences: prompts of
``--prompt`` tokens and lognormal responses (median ``--median``, sigma ``--sigma``, at most ``--cap`` tokens;
``--seed``). Three packings of the same batch on the same model:

- ``consecutive``: ``actor.packing=consecutive`` (contiguous DP shares, micro-batches of neighbours under the
  budget): megarl before variable-length batches.
- ``sorted``: the default (token-balanced DP shares, each packed longest first under the budget).
- ``floor``: every sequence a micro-batch of its own (no padding at all: the same attention FLOPs as the real
  tokens), on the default's DP shares.

Each step runs the three in turn (round robin, so a drift of the machine's speed hits each alike); after
``--warmup`` steps, the medians of ``--steps``: padding share (padded / computed positions over both passes and both
ranks, ``perf/padding_frac``), micro-batches (``perf/micro_batches``), the update's seconds (rank 0's wall clock of
``learn``), and the medians of the per-step ratios to the floor and to consecutive.

    python benchmarks/varlen.py                       # ~4 minutes here
    python benchmarks/varlen.py --json                # the rows as a JSON list
    python benchmarks/varlen.py --budget 16384 --steps 7
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "consecutive": ["actor.packing=consecutive"],
    "sorted": [],
    "floor": ["actor.max_tokens_per_micro_batch=0", "actor.micro_batch_size=1"],
}
N = 8
"""Samples per prompt (GRPO's groups)."""


def response_lengths(args) -> list[int]:
    rng = random.Random(args.seed)
    return [min(args.cap, max(1, round(args.median * math.exp(rng.gauss(0.0, args.sigma)))))
            for _ in range(args.sequences)]  # fmt: skip


def fixed_batch(args, vocab: int):
    """``--sequences`` samples of ``--prompt``-token prompts (``N`` per prompt) and the lognormal responses, with
    engine-like log-probs and rewards."""
    from megarl.rl.collect import Collected
    from megarl.rollout.protocol import Sample

    rng = random.Random(args.seed + 1)
    out = Collected()
    for k, n in enumerate(response_lengths(args)):
        p, j = divmod(k, N)
        if j == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt)]
        response = [rng.randrange(3, vocab) for _ in range(n)]
        out.samples.append(Sample(p, j, prompt, response, [-rng.uniform(4.0, 7.0) for _ in response], "stop",
                                  [0] * n))  # fmt: skip
        out.rewards.append(rng.random())
    out.scores = list(out.rewards)
    return out


def _worker(hf_dir: str, args) -> dict:
    import torch
    import torch.distributed as dist

    from megarl.algos import kl_controller
    from megarl.backend.models import build_rl_models
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.source import model_source
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rl.roles import make_roles
    from megarl.rl.step import learn
    from megarl.rl.timer import PhaseTimer

    torch.set_num_threads(1)
    layout = ParallelLayout(dp=2)
    base = [f"model.path={hf_dir}", "actor.parallel.dp=2", "actor.optim.optimizer=sgd", "actor.optim.lr=1e-6",
            "algorithm.adv_estimator=grpo", f"rollout.sampling.n={N}", f"data.train_batch_size={args.sequences // N}",
            f"actor.global_batch_size={args.sequences}", f"actor.max_tokens_per_micro_batch={args.budget}",
            f"actor.seq_length={args.prompt + args.cap}", f"model.dtype={args.dtype}"]  # fmt: skip
    configs = {name: load_config(None, [*base, *extra]) for name, extra in VARIANTS.items()}
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    init_distributed(layout, seed=1)
    models = build_rl_models(configs["sorted"], spec, layout, model_source(hf_dir), dist.get_rank())
    roles = {name: make_roles(cfg, spec, models) for name, cfg in configs.items()}
    batch = fixed_batch(args, spec.vocab_size)
    kl = kl_controller("fixed", 0.0, 0.0, 1000)
    seconds = {name: [] for name in VARIANTS}
    packed = {}
    for step in range(args.warmup + args.steps):
        for name, cfg in configs.items():
            dist.barrier()
            start = time.perf_counter()
            learned = learn(cfg, roles[name], batch, kl_ctrl=kl, skip_old_logprob=False, timer=PhaseTimer())
            dist.barrier()
            if step >= args.warmup:
                seconds[name].append(time.perf_counter() - start)
            packed[name] = learned.packed
    return {"seconds": seconds, "packed": {k: (v.computed, v.real, v.micro_batches) for k, v in packed.items()}}


def rows_of(result: dict) -> list[dict]:
    seconds = result["seconds"]

    def ratio(name: str, other: str) -> float:  # the median of the per-step ratios (the same step's machine)
        return statistics.median(a / b for a, b in zip(seconds[name], seconds[other]))

    rows = []
    for name in VARIANTS:
        computed, real, micro = result["packed"][name]
        rows.append({"packing": name, "padding_share": 1 - real / computed, "micro_batches": micro,
                     "update_s": statistics.median(seconds[name]), "to_floor": ratio(name, "floor"),
                     "to_consecutive": ratio(name, "consecutive"), "seconds": seconds[name]})  # fmt: skip
    return rows


def table(rows: list[dict], args) -> str:
    lengths = sorted(response_lengths(args))
    lines = [
        f"{args.sequences} sequences: prompts of {args.prompt} tokens, responses lognormal (median {args.median}, "
        f"sigma {args.sigma}, cap {args.cap}; seed {args.seed}: median {statistics.median(lengths):.0f}, "
        f"max {lengths[-1]}); a tiny Llama ({args.dtype}), DP=2, budget {args.budget} tokens per micro-batch; "
        f"old log-probs + one GRPO update, medians of {args.steps} steps after {args.warmup}",
        "",
        "| packing | padding share | micro-batches (2 passes, 2 ranks) | update s | ratio to floor "
        "| ratio to consecutive |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['packing']} | {r['padding_share']:.1%} | {r['micro_batches']} | {r['update_s']:.2f} "
                     f"| {r['to_floor']:.2f} | {r['to_consecutive']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--median", type=float, default=300)
    parser.add_argument("--sigma", type=float, default=0.7)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=4096,
                        help="actor.max_tokens_per_micro_batch (default: about twice the longest sequence)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    args = parser.parse_args(argv)
    if args.sequences % (2 * N):
        parser.error(f"--sequences must be a multiple of {2 * N}")
    sys.path.insert(0, REPO)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megarl.models.tiny import make_tiny_hf_model
    from megarl.parallel.spawn import run_on_ranks

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_hf_model(f"{tmp}/llama", "llama", max_position_embeddings=args.prompt + args.cap + 8)
        rows = rows_of(run_on_ranks(_worker, 2, hf, args))
    print(json.dumps(rows, indent=1) if args.json else table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
