"""Reward functions that misbehave on the samples whose prompt holds one of the digits in $MEGARL_TEST_BAD_DIGITS
(default "7"; the built-in digits task has one digit per prompt) and score every other sample 1.0. Used by
name (``tests/misbehaving_rewards.py:hang`` or ``tests.misbehaving_rewards:hang``) from worker processes.

$MEGARL_TEST_MARKER, if set: a file each misbehaving call appends a line to before it misbehaves."""

import math
import os
import subprocess
import sys
import time


def _bad(prompt: str) -> bool:
    return any(d in prompt for d in os.environ.get("MEGARL_TEST_BAD_DIGITS", "7"))


def _mark(what: str) -> None:
    marker = os.environ.get("MEGARL_TEST_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(f"{what} {os.getpid()}\n")


def _misbehaves(prompts) -> bool:
    return any(_bad(p) for p in prompts)


def hang(prompts, responses, ground_truths, extras):
    if _misbehaves(prompts):
        _mark("hang")
        time.sleep(3600)
    return [1.0] * len(prompts)


_calls = [0]


def hang_every_second_call(prompts, responses, ground_truths, extras):
    """Every second call in each worker process never returns (a replaced worker starts counting again); the
    others score every sample 1.0."""
    _calls[0] += 1
    if _calls[0] % 2 == 0:
        _mark("hang")
        time.sleep(3600)
    return [1.0] * len(prompts)


def hang_with_child(prompts, responses, ground_truths, extras):
    """Starts a process (a sandbox) and hangs: the timeout must take the child too."""
    if _misbehaves(prompts):
        child = subprocess.Popen(["sleep", "600"])
        _mark(f"child {child.pid}")
        time.sleep(3600)
    return [1.0] * len(prompts)


def exits(prompts, responses, ground_truths, extras):
    if _misbehaves(prompts):
        _mark("exit")
        sys.exit(0)
    return [1.0] * len(prompts)


def dies(prompts, responses, ground_truths, extras):
    if _misbehaves(prompts):
        _mark("os._exit")
        os._exit(1)
    return [1.0] * len(prompts)


def segfault(prompts, responses, ground_truths, extras):
    if _misbehaves(prompts):
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return [1.0] * len(prompts)


def nan(prompts, responses, ground_truths, extras):
    return [math.nan if _bad(p) else 1.0 for p in prompts]


def always_raises(prompts, responses, ground_truths, extras):
    raise KeyError(f"no judge for {prompts[0]!r}: the reward is broken")


def graded(prompts, responses, ground_truths, extras):
    """Well behaved: a score and extra fields that depend on the sample only."""
    return [{"score": len(r) / 10, "format": float(r.startswith("1")), "digit": float(p[-2])}
            for p, r in zip(prompts, responses)]  # fmt: skip


def slow_graded(prompts, responses, ground_truths, extras):
    """``graded`` after marking the call's start and sleeping $MEGARL_TEST_SLOW_S seconds (a judge's latency)."""
    _mark("start")
    time.sleep(float(os.environ.get("MEGARL_TEST_SLOW_S", "0")))
    return graded(prompts, responses, ground_truths, extras)


def reads_credentials(prompts, responses, ground_truths, extras):
    """1.0 where the worker sees $MEGARL_TEST_API_KEY, 0.5 where it does not; a bad sample also needs
    $MEGARL_TEST_PLAIN (an ordinary variable, which every worker gets)."""
    seen = 1.0 if "MEGARL_TEST_API_KEY" in os.environ else 0.5
    return [seen if os.environ.get("MEGARL_TEST_PLAIN") == "x" else 0.0 for _ in prompts]


def allocates(prompts, responses, ground_truths, extras):
    """A bad sample allocates 3 GiB (past a reward.max_memory_gb of 1: MemoryError), the others 64 MiB."""
    blob = bytearray((3 << 30) if _misbehaves(prompts) else (64 << 20))
    return [1.0 + 0 * len(blob)] * len(prompts)
