"""Synchronous, one-step-off and bounded-staleness RL on the same pools, side by side in one run (GRPO, `megarl
train`).

Both modes run the same recipe on the same pools (default: the actor at TP=1 on rank 0, one vLLM engine at TP=1 on
rank 1, one core each on this machine; ``--tp 2``: configs/tiny_grpo_pools.yaml's 2 + 2 ranks), with the same
prompts, samples and rollout correction (algorithm.rollout_is=token_truncate in both):

- sync: generate and score batch k, then learn from it, then push the weights;
- one_step_off: the rollout pool generates and scores batch k+1 while the train pool learns from batch k;
- bounded: the rollout pool streams prompt groups without waiting (max_staleness 2, partial rollout ``recompute``,
  a push per update).

Three cases:

(a) the plain toy reward (the built-in digits score, microseconds);
(b) a latency-bound reward (benchmarks/latency_reward.py: the same score after a sleep, as a remote judge or a
    sandbox would take) whose sleep is the median ``timing/update_actor`` measured by (a)'s synchronous run here;
    each prompt group is one call, sent as the engine finishes the group, and the workers (one per prompt) wait
    side by side, so a batch's reward takes about one sleep after its last group;
(c) a long tail: the toy reward, but most answers stop early (a stop set of ~1 in 10 of the tiny model's tokens,
    so lengths are geometric) and a few run to a 4x larger ``max_new_tokens``: a synchronous batch waits for its
    longest answer, a stream keeps the engine busy with the next prompts meanwhile.

Per run: 1 warm-up step, then medians of the measured steps: the step time, each pool's idle share (``pool/<name>/
wait_s`` over the step) and the throughput ratios (sync step time / the other mode's, samples per step equal).

What 2 cores can show: the overlap of time spent waiting (the latency-bound reward) with training, and, with one rank
per core, some overlap of generation with training. What they cannot: compute-bound overlap at scale (4 ranks on 2
cores contend; GPUs do not), so case (a)'s ratio here says little about a GPU cluster; `megarl plan` estimates the
step from the recipe's model, layouts and hardware instead.

    python benchmarks/async_step.py            # ~6 minutes here
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from tiny_runs import train_rows  # benchmarks/tiny_runs.py (run as a script: this directory is on the path)


def pools(tp: int) -> list[str]:
    train, rollout = ("0", "1") if tp == 1 else ("0-1", "2-3")
    return [f"placement.pools.train.ranks={train}", "placement.pools.train.roles=[actor]",
            f"placement.pools.rollout.ranks={rollout}", "placement.pools.rollout.roles=[rollout]",
            f"actor.parallel.tp={tp}", f"rollout.tp={tp}"]  # fmt: skip


MODES = {
    "sync": ["async_training.mode=sync"],
    "one_step_off": ["async_training.mode=one_step_off"],
    "bounded": ["async_training.mode=bounded", "async_training.max_staleness=2",
                "async_training.partial_rollout=recompute"],
}  # fmt: skip
LONG_TAIL_STOP = list(range(3, 320, 10))
"""(c): about 1 in 10 of the tiny model's 320 tokens ends an answer."""


def run(hf_dir: str, out: str, mode: str, sleep_s: float | None, args, long_tail: bool = False) -> list[dict]:
    extra = []  # a latency-bound reward: each call (one prompt group) waits sleep_s, all groups' calls at once
    if sleep_s:
        extra = ["reward.function=benchmarks/latency_reward.py:sleepy", f"reward.num_workers={args.prompts}"]
    if long_tail:
        extra += [f"rollout.sampling.stop_token_ids=[{','.join(map(str, LONG_TAIL_STOP))}]"]
    overrides = ["trainer.save_every=0", "algorithm.rollout_is=token_truncate", *MODES[mode], *pools(args.tp), *extra]
    return train_rows(hf_dir, out, overrides, steps=args.steps, prompts=args.prompts, n=args.n,
                      new_tokens=args.new_tokens * (4 if long_tail else 1),
                      env={"MEGARL_BENCH_REWARD_SLEEP_S": str(sleep_s or 0)})  # fmt: skip


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--tp", type=int, default=1, choices=(1, 2), help="ranks per pool (the actor's TP = rollout.tp)")
    args = p.parse_args()
    from megarl.models.tiny import make_tiny_hf_model

    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_hf_model(os.path.join(tmp, "llama"), "llama", seed=3, init_std=0.08)
        for mode in MODES:
            runs["a", mode] = run(hf, os.path.join(tmp, f"a-{mode}"), mode, None, args)
        sleep_s = median(runs["a", "sync"], "timing/update_actor")
        for mode in MODES:
            runs["b", mode] = run(hf, os.path.join(tmp, f"b-{mode}"), mode, sleep_s, args)
        for mode in MODES:
            runs["c", mode] = run(hf, os.path.join(tmp, f"c-{mode}"), mode, None, args, long_tail=True)
    print(f"GRPO, {args.prompts} prompts x {args.n} samples x {args.new_tokens} new tokens; pools: actor TP={args.tp} "
          f"and one engine TP={args.tp} ({2 * args.tp} ranks) on this machine's {os.cpu_count()} cores; medians of "
          f"{args.steps} steps after 1 warm-up\n")  # fmt: skip
    cases = {"a": "(a) toy reward", "b": f"(b) latency-bound reward (sleeps {sleep_s:.3f} s per call, {args.prompts} "
             "calls at once)", "c": f"(c) long tail (max_new_tokens {4 * args.new_tokens}, most answers stop early)"}
    for case, title in cases.items():
        print(title)
        print(f"  {'':14}{'step s':>9}{'generate':>10}{'reward':>9}{'update':>9}{'sync':>8}"
              f"{'train idle':>12}{'rollout idle':>14}{'length':>8}{'max':>6}")  # fmt: skip
        for mode in MODES:
            rows = runs[case, mode]
            step = median(rows, "timing/step")
            idle = [median(rows, f"pool/{pool}/wait_s") / step for pool in ("train", "rollout")]
            print(f"  {mode:14}{step:9.3f}{median(rows, 'timing/generate'):10.3f}{median(rows, 'timing/reward'):9.3f}"
                  f"{median(rows, 'timing/update_actor'):9.3f}{median(rows, 'timing/sync'):8.3f}"
                  f"{idle[0]:12.0%}{idle[1]:14.0%}{median(rows, 'response_length/mean'):8.1f}"
                  f"{median(rows, 'response_length/max'):6.0f}")  # fmt: skip
        for mode in ("one_step_off", "bounded"):
            ratio = median(runs[case, "sync"], "timing/step") / median(runs[case, mode], "timing/step")
            lags = sorted({r["async/lag_max"] for r in runs[case, mode]})
            print(f"  throughput {mode} / sync: {ratio:.2f}x (lag_max {lags} after the warm-up step)")
        print()


if __name__ == "__main__":
    main()
