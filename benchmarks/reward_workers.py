"""What running a user's reward in worker processes costs per batch, next to calling it in the trainer's process,
side by side in one run: the quickstart's reward (``toy_digits``) on the quickstart's batch (8 prompts x 8 samples
of 8 tokens), once in process (``InProcess``, the built-in path) and once as a user function
(``megarl.rewards.toy:toy_digits`` in a ``RewardPool``: the same function, the worker path), alternating; medians.
Also: starting a pool, and replacing a worker (what a timed-out or crashed call costs beyond its timeout).

With ``--quickstart-steps N``: the quickstart itself (`megarl train configs/quickstart.yaml`, 2 ranks, vLLM) for N
steps with each path, one after the other; medians of the step's ``timing/reward`` (rollout decode, scoring on every
rank, the all-gather) and ``timing/step``.

    python benchmarks/reward_workers.py                         # ~5 s here
    python benchmarks/reward_workers.py --quickstart-steps 30   # ~2 minutes more
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from megarl.data.builtin import builtin_records
from megarl.rewards.scorer import InProcess
from megarl.rewards.worker_pool import RewardPool, default_num_workers


def _batch(samples: int, seed: int = 0):
    """Quickstart-like samples: digit prompts, responses of 8 tokens' worth of text."""
    rng = random.Random(seed)
    records = builtin_records("builtin:digits", "train")[:samples]
    chars = "0123456789 abcxyz:"
    responses = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 12))) for _ in records]
    return [r["prompt"] for r in records], responses, [r["answer"] for r in records], [{} for _ in records]


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--samples", type=int, default=64, help="samples per batch (quickstart: 8 prompts x 8)")
    parser.add_argument("--workers", type=int, default=default_num_workers())
    parser.add_argument("--quickstart-steps", type=int, default=0, help="also time N quickstart steps per path")
    args = parser.parse_args()
    batch = _batch(args.samples)
    in_process = InProcess("toy_digits")
    starts = []
    for _ in range(5):
        t = time.perf_counter()
        RewardPool("megarl.rewards.toy:toy_digits", num_workers=args.workers, timeout_s=60).close()
        starts.append(time.perf_counter() - t)
    with RewardPool("megarl.rewards.toy:toy_digits", num_workers=args.workers, timeout_s=60) as pool:
        assert pool.score(*batch) == in_process.score(*batch)  # the same scores either way
        inside, workers = [], []
        for _ in range(args.repeats):
            inside.append(_seconds(lambda: in_process.score(*batch)))
            workers.append(_seconds(lambda: pool.score(*batch)))
        replace = []
        for _ in range(10):
            t = time.perf_counter()
            pool._replace(pool.workers[0])  # kill + start; then wait until it has loaded the function
            while not pool.workers[0].ready:
                pool._wait([pool.workers[0]], time.monotonic() + 60, None)
            replace.append(time.perf_counter() - t)
    a, b = statistics.median(inside), statistics.median(workers)
    print(f"reward per batch of {args.samples} samples (toy_digits, medians of {args.repeats}, alternating):")
    print(f"  in the trainer's process      {a * 1e3:8.3f} ms")
    extra = f"({b / a:.1f}x; {(b - a) * 1e3:+.2f} ms per batch)"
    print(f"  in {args.workers} worker process(es)     {b * 1e3:8.3f} ms   {extra}")
    print(f"start a pool of {args.workers} worker(s): {statistics.median(starts) * 1e3:.0f} ms (median of 5)")
    print(f"replace one worker (kill, start, load): {statistics.median(replace) * 1e3:.0f} ms (median of 10)")
    if args.quickstart_steps:
        _quickstart(args.quickstart_steps)


def _quickstart(steps: int) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny-llama")
        subprocess.run([sys.executable, "-m", "megarl.cli", "tiny-model", "--out", model], check=True, cwd=repo,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for label, reward in (("in process", "toy_digits"), ("workers", "megarl.rewards.toy:toy_digits")):
            out = os.path.join(tmp, label.replace(" ", "_"))
            cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/quickstart.yaml", f"model.path={model}",
                   f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.val_every=0",
                   "logging.wandb.mode=disabled", "logging.progress_bar=false",
                   f"reward.function={reward}"]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]  # step 1: warm-up
            medians[label] = {k: statistics.median(r[k] for r in rows) for k in ("timing/reward", "timing/step")}
    a, b = medians["in process"], medians["workers"]
    print(f"quickstart (2 ranks, 64 samples per step), medians of steps 2-{steps}:")
    for key in ("timing/reward", "timing/step"):
        print(f"  {key:14s} in process {a[key] * 1e3:7.2f} ms   workers {b[key] * 1e3:7.2f} ms   "
              f"({(b[key] - a[key]) * 1e3:+.2f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
