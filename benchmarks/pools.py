"""Colocated vs resource pools on the same 4 ranks, side by side in one run (GRPO, `megarl train`).

- colocated: the actor at TP=2 x DP=2 on ranks 0-3, two colocated vLLM engines at TP=2 (every rank does every phase);
- pooled: the actor at TP=2 on ranks 0-1, one vLLM engine at TP=2 on ranks 2-3 (configs/tiny_grpo_pools.yaml's
  placement); the same prompts, samples per prompt and token budget.

Per configuration: 1 warm-up step, then the median of the measured steps of each phase, the sync's bytes, and with
pools each pool's busy and waiting share of the step.

What this machine can and cannot show: it has 2 cores. Colocated, 4 ranks share them (each phase runs on all four,
oversubscribed 2x, and vLLM-CPU's shared-memory all-reduce spins while it waits); pooled, only the pool whose turn it
is computes, on 2 ranks, while the other waits (the step stays synchronous: rollout, then training). Measured here
(defaults): generation 0.27x, the update 0.76x, the whole step 0.39x of colocated's time -- fewer processes on 2 cores,
not what GPUs give. So the step times compare the two schedules on the same cores, not
what dedicated GPUs give: on GPUs the pooled actor keeps its whole memory (no sleep, no offload; `megarl plan`), the
engines need not wait for an offload/reload, and asynchronous rollout (next) overlaps the pools' busy times, which
`pool/<name>/wait_s` measures here.

    python benchmarks/pools.py            # ~4 minutes here
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from tiny_runs import train_rows  # benchmarks/tiny_runs.py (run as a script: this directory is on the path)

PHASES = ("generate", "reward", "update_actor", "sync", "step")
POOLS = ["placement.pools.train.ranks=0-1", "placement.pools.train.roles=[actor]",
         "placement.pools.rollout.ranks=2-3", "placement.pools.rollout.roles=[rollout]"]  # fmt: skip


def run(hf_dir: str, out: str, extra: list[str], args) -> list[dict]:
    return train_rows(hf_dir, out, extra, steps=args.steps, prompts=args.prompts, n=args.n,
                      new_tokens=args.new_tokens)  # fmt: skip


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    from megarl.models.tiny import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_hf_model(os.path.join(tmp, "llama"), "llama", seed=3, init_std=0.08)
        colocated = run(hf, os.path.join(tmp, "c"), ["actor.parallel.dp=2"], args)
        runs = {
            "colocated (TP2 x DP2, 2 engines on the same ranks)": colocated,
            "pooled (TP2 on 0-1, 1 engine on 2-3)": run(hf, os.path.join(tmp, "p"), POOLS, args),
        }
    print(f"GRPO, {args.prompts} prompts x {args.n} samples x {args.new_tokens} new tokens, 4 ranks on this machine's "
          f"{os.cpu_count()} cores; medians of {args.steps} steps after 1 warm-up\n")  # fmt: skip
    names = list(runs)
    print(f"{'seconds':24}" + "".join(f"{n.split(' ')[0]:>12}" for n in names) + f"{'ratio':>9}")
    for phase in PHASES:
        vals = [median(runs[n], f"timing/{phase}") for n in names]
        print(f"{'timing/' + phase:24}" + "".join(f"{v:12.3f}" for v in vals) + f"{vals[1] / vals[0]:9.2f}x")
    sent = [median(runs[n], "sync/bytes_sent") / 2**20 for n in names]
    print(f"{'sync MiB moved':24}" + "".join(f"{v:12.2f}" for v in sent))
    pooled = runs[names[1]]
    step = median(pooled, "timing/step")
    for pool in ("train", "rollout"):
        busy, wait = median(pooled, f"pool/{pool}/busy_s"), median(pooled, f"pool/{pool}/wait_s")
        print(f"pool {pool}: busy {busy:.3f} s ({busy / step:.0%} of the step), waiting {wait:.3f} s "
              f"({wait / step:.0%})")  # fmt: skip
    for n in names:
        print(f"{n}: step {median(runs[n], 'timing/step'):.3f} s")


if __name__ == "__main__":
    main()
