"""Multi-turn episodes synchronous and bounded-staleness streaming on the same pools, side by side in one run
(`megarl train configs/tiny_multiturn_bounded.yaml`: the actor on ranks 0-1, one vLLM engine on ranks 2-3).

The environment is builtin:repeat whose every step sleeps ``--sleep`` seconds (benchmarks/slow_env.py: a tool call
that takes its time: a sleep, no CPU), 2 turns per episode, 8 environment workers per rank. Synchronous: every turn
of the batch waits for the batch's slowest call, then the update waits for the batch. Bounded (max_staleness 2,
partial rollout): the engine goes on with other episodes while calls run, and the rollout pool generates ahead of the
learners.

Per mode: ``--steps`` steps, the first 2 dropped (start-up, the stream filling); the median ``timing/step`` and the
ratio sync / bounded.

    python benchmarks/agent_step.py            # ~4 minutes here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode: str, model: str, out: str, steps: int, sleep: float) -> list[dict]:
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/tiny_multiturn_bounded.yaml", f"model.path={model}",
           f"trainer.output_dir={out}", "trainer.resume=never", f"trainer.total_steps={steps}", "trainer.val_every=0",
           "trainer.save_every=0", "logging.wandb.mode=disabled", "logging.progress_bar=false",
           f"async_training.mode={mode}", "env.class=benchmarks/slow_env.py:SlowRepeat",
           f"env.kwargs.sleep_s={sleep}", "env.num_workers=8", "data.train_batch_size=4",
           "actor.global_batch_size=32"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--model", default=os.path.join(REPO, ".cache", "tiny-llama"))
    args = ap.parse_args()
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "bounded"):
            rows = [r for r in run(mode, args.model, os.path.join(tmp, mode), args.steps, args.sleep) if r["step"] > 2]
            medians[mode] = statistics.median(r["timing/step"] for r in rows)
            reward = statistics.fmean(r["reward/mean"] for r in rows)
            print(f"{mode:8s} median s/step {medians[mode]:.2f} over steps 3-{args.steps} (reward {reward:.3f}, "
                  f"env/step_seconds {statistics.fmean(r['env/step_seconds'] for r in rows):.2f} per episode)")
    print(f"sync / bounded: {medians['sync'] / medians['bounded']:.2f}x (a {args.sleep:g} s environment step, "
          "2 turns per episode, 32 episodes per step)")


if __name__ == "__main__":
    main()
