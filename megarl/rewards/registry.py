"""Reward functions by name: built-ins, ``path/to/file.py:fn`` or ``package.module:fn``.

Every reward is a batch function ``fn(prompts, responses, ground_truths, extras) -> list[float | dict]`` (a dict
holds a float ``score`` and optional extra numeric fields, logged as ``reward/<field>``)."""

from __future__ import annotations

import importlib
import importlib.util
import os

from megarl.rewards.gsm8k import gsm8k, gsm8k_flexible
from megarl.rewards.math_verify_reward import math
from megarl.rewards.toy import toy_digits

BUILTIN_REWARDS = {"toy_digits": toy_digits, "gsm8k": gsm8k, "gsm8k_flexible": gsm8k_flexible, "math": math}


class RewardLoadError(ValueError):
    """``reward.function`` names nothing callable; the message says what and how to fix it."""


def _forms() -> str:
    return f"a built-in ({', '.join(BUILTIN_REWARDS)}), 'path/to/file.py:fn' or 'package.module:fn'"


def load_reward_fn(spec: str):
    """The callable ``spec`` names; RewardLoadError otherwise."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise RewardLoadError(f"unknown reward {spec!r}; use {_forms()}")
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise RewardLoadError(f"reward file not found: {where} (from {spec!r}); use {_forms()}")
        module_spec = importlib.util.spec_from_file_location(f"megarl_user_reward_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardLoadError(f"importing {where} (from {spec!r}) failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise RewardLoadError(
                f"importing module {where!r} (from {spec!r}) failed: {type(e).__name__}: {e}"
            ) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardLoadError(f"{where} has no attribute {name!r} (from {spec!r})")
    if not callable(fn):
        raise RewardLoadError(f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn
