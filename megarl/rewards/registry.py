"""Reward functions by name: built-ins, ``path/to/file.py:fn`` or ``package.module:fn``.

Every reward is a batch function ``fn(prompts, responses, ground_truths, extras) -> list[float | dict]`` (a dict
holds a float ``score`` and optional extra numeric fields, logged as ``reward/<field>``)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback

from megarl.rewards.gsm8k import gsm8k, gsm8k_flexible
from megarl.rewards.math_verify_reward import math
from megarl.rewards.toy import toy_digits

BUILTIN_REWARDS = {"toy_digits": toy_digits, "gsm8k": gsm8k, "gsm8k_flexible": gsm8k_flexible, "math": math}
"""name -> batch reward function."""

SIGNATURE = "fn(prompts, responses, ground_truths, extras) -> list[float | dict]"


class RewardLoadError(ValueError):
    """``reward.function`` names nothing callable; the message says what and how to fix it."""


def _forms() -> str:
    return f"a built-in ({', '.join(BUILTIN_REWARDS)}), 'path/to/file.py:fn' or 'package.module:fn'"


def _load_file(path: str, spec: str, what: str = "reward", reuse: bool = False):
    """The module of a user's .py file (relative paths from the CWD), registered in sys.modules so that its
    dataclasses and pickling work; its name derives from the absolute path (a second load re-runs it under it,
    unless ``reuse``: then the module loaded first stays, and objects pickled with its classes load again)."""
    if not os.path.isfile(path):
        raise RewardLoadError(f"{what} file not found: {path} (from {spec!r}, CWD {os.getcwd()}); use {_forms()}")
    path = os.path.abspath(path)
    name = "megarl_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if reuse and name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardLoadError(
            f"importing {what} file {_where_raised(e, path)} (from {spec!r}) failed: {type(e).__name__}: {e}; "
            "fix that module"
        ) from e
    return module


def _where_raised(e: Exception, path: str) -> str:
    """'path:line' of the user's file where ``e`` was raised (the deepest frame in it), or just ``path``."""
    if isinstance(e, SyntaxError) and e.filename == path and e.lineno:
        return f"{path}:{e.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
    return f"{path}:{lines[-1]}" if lines else path


def _load_module(where: str, spec: str):
    try:
        return importlib.import_module(where)
    except Exception as e:
        raise RewardLoadError(
            f"importing module {where!r} (from {spec!r}) failed: {type(e).__name__}: {e}; check that it is "
            f"importable (installed or on PYTHONPATH), or give a file as 'path/to/file.py:fn'"
        ) from e


def load_reward_fn(spec: str):
    """The callable ``spec`` names; RewardLoadError (naming the spec and the fix) otherwise."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    return load_named(spec, "reward")


def load_named(spec: str, what: str, reuse: bool = False):
    """The callable (a function or a class) ``spec`` names as 'path/to/file.py:name' or 'package.module:name';
    RewardLoadError naming the spec, ``what`` it is for (reward, environment, tool) and the fix otherwise.
    ``reuse``: a file loaded before is not run again (``_load_file``)."""
    if ":" not in spec:
        hint = f"; to name a function in {spec}, write '{spec}:fn'" if spec.endswith(".py") else ""
        raise RewardLoadError(f"unknown {what} {spec!r}; use {_forms()}{hint}")
    where, _, name = spec.rpartition(":")
    module = _load_file(where, spec, what, reuse) if where.endswith(".py") else _load_module(where, spec)
    if not name or not hasattr(module, name):
        defined = sorted(
            k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__
        )
        raise RewardLoadError(
            f"{where} has no attribute {name!r} (from {spec!r}); functions defined there: {defined[:20]}; "
            "name one after the ':'"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardLoadError(f"{spec!r} is a {type(fn).__name__}, not a function; name a function {SIGNATURE}")
    return fn
