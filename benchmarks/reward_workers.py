"""What running a user's reward in worker processes costs per batch, next to calling it in the trainer's process,
side by side in one run: the quickstart's reward (``toy_digits``) on the quickstart's batch (8 prompts x 8 samples
of 8 tokens), once in process (``InProcess``, the built-in path) and once as a user function
(``megarl.rewards.toy:toy_digits`` in a ``RewardPool``: the same function, the worker path), alternating; medians.
Also: starting a pool, and replacing a worker (what a timed-out or crashed call costs beyond its timeout).

    python benchmarks/reward_workers.py            # ~10 s here
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from megarl.data.builtin import builtin_records
from megarl.rewards.pool import RewardPool, default_num_workers
from megarl.rewards.scorer import InProcess


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
    extra = f"({b / a:.0f}x; +{(b - a) * 1e3:.2f} ms per batch)"
    print(f"  in {args.workers} worker process(es)     {b * 1e3:8.3f} ms   {extra}")
    print(f"start a pool of {args.workers} worker(s): {statistics.median(starts) * 1e3:.0f} ms (median of 5)")
    print(f"replace one worker (kill, start, load): {statistics.median(replace) * 1e3:.0f} ms (median of 10)")


if __name__ == "__main__":
    main()
