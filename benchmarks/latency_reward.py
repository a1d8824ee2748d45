"""A latency-bound reward for benchmarks/async_step.py: the toy digits score after sleeping
$MEGARL_BENCH_REWARD_SLEEP_S seconds per call (one prompt group), as a remote judge or a sandbox would take: the
time is spent waiting, not computing. Used by name (``benchmarks/latency_reward.py:sleepy``); it runs in the reward
worker processes."""

import os
import time

from megarl.rewards.toy import toy_digits


def sleepy(prompts, responses, ground_truths, extras):
    time.sleep(float(os.environ.get("MEGARL_BENCH_REWARD_SLEEP_S", "0")))
    return toy_digits(prompts, responses, ground_truths, extras)
