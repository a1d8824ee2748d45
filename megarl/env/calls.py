"""An environment's calls, run in worker processes (``RewardPool(kind='calls')``, isolated like user rewards) or in
the trainer's process (``env.num_workers=0``).

``env_calls(labels, classes, states, actions)`` answers one call per episode: ``("reset", record)`` builds the
environment (``classes[i]``: its spec and constructor kwargs) and returns its first prompt; ``("step", text, ids)``
restores the environment from ``states[i]`` (pickled by the call before) and returns what its ``step`` gave. An
episode's environment lives between calls as those bytes, so any worker can take its next call and a worker that
dies costs only the episode it was running. Every value an environment returns is checked here; a bad one is that
episode's failure (``megarl.rewards.results.Failure``), with what was wrong."""

from __future__ import annotations

import math
import pickle
import time

from megarl.rewards.registry import RewardLoadError, load_named
from megarl.rewards.results import raised

BUILTIN_ENVS = {"builtin:tools": "megarl.env.tools:ToolEnv", "builtin:repeat": "megarl.env.toy:RepeatEnv"}
"""``env.class`` built-ins -> their classes."""

_loaded: dict[str, type] = {}


def load_env_class(spec: str) -> type:
    """The environment class ``spec`` names (a built-in, 'path/to/file.py:Class' or 'package.module:Class');
    RewardLoadError saying what is wrong otherwise."""
    if spec.startswith("builtin:") and spec not in BUILTIN_ENVS:
        raise RewardLoadError(f"unknown environment {spec!r}; the built-ins are {sorted(BUILTIN_ENVS)}")
    spec = BUILTIN_ENVS.get(spec, spec)
    if spec not in _loaded:
        cls = load_named(spec, "environment", reuse=True)  # one class per file: an episode's pickle loads again
        if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
            raise RewardLoadError(f"env.class {spec!r} is not a class with reset(record) and step(assistant_text, "
                                  "assistant_token_ids)")  # fmt: skip
        _loaded[spec] = cls
    return _loaded[spec]


def check_loads(spec: str, kwargs: dict) -> None:
    """Load the environment class and let it check its kwargs (``builtin:tools`` loads each tool): a dry run's
    ``("load",)`` call."""
    cls = load_env_class(spec)
    if hasattr(cls, "check"):
        cls.check(**kwargs)


def env_calls(labels: list[str], classes: list[tuple[str, dict]], states: list, actions: list) -> list:
    """One answer per episode (a dict, or the ``Failure`` of its call)."""
    out = []
    for (spec, kwargs), state, action in zip(classes, states, actions):
        try:
            out.append(_call(spec, kwargs, state, action))
        except (Exception, SystemExit):  # this episode's failure; the worker goes on with the others
            out.append(raised())
    return out


def _call(spec: str, kwargs: dict, state: bytes | None, action: tuple) -> dict:
    cls = load_env_class(spec)
    start = time.perf_counter()
    if action[0] == "load":
        check_loads(spec, kwargs)
        return {}
    if action[0] == "reset":
        env = cls(**kwargs)
        first = check_prompt(env.reset(action[1]))
        tools = env.tool_schemas() if callable(getattr(env, "tool_schemas", None)) else None
        return {"state": _pickled(env), "saved": saved_state(env), "prompt": first, "tools": tools,
                "seconds": time.perf_counter() - start}  # fmt: skip
    if isinstance(state, dict):  # a checkpoint's: the environment rebuilt from its state_dict
        env = cls(**kwargs)
        env.load_state_dict(state["state_dict"])
    else:
        env = pickle.loads(state)
    observation, reward, done, info = check_step(env.step(action[1], list(action[2])))
    return {"state": None if done else _pickled(env), "saved": None if done else saved_state(env),
            "observation": observation, "reward": reward, "done": done, "info": info,
            "seconds": time.perf_counter() - start}  # fmt: skip


def has_state_dict(cls) -> bool:
    """Whether an environment class can be saved into a checkpoint (``state_dict()`` and ``load_state_dict(d)``):
    its episodes in flight continue after a resume; the others start over."""
    return callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None))


def saved_state(env) -> dict | None:
    """``{"state_dict": env.state_dict()}`` (checked to pickle: a checkpoint holds it), or None without one (also
    when ``state_dict()`` returns None: the episode cannot be saved at this point and starts over on resume)."""
    if not has_state_dict(type(env)):
        return None
    sd = env.state_dict()
    if sd is None:
        return None
    try:
        pickle.dumps(sd)
    except Exception as e:
        raise TypeError(f"the environment's state_dict() could not be pickled ({type(e).__name__}: {e})") from e
    return {"state_dict": sd}


def _pickled(env) -> bytes:
    try:
        return pickle.dumps(env)
    except Exception as e:
        raise TypeError(f"the environment could not be pickled between turns ({type(e).__name__}: {e}); keep its "
                        "state in plain attributes (open clients lazily, in step)") from e  # fmt: skip


def _message(m, where: str) -> dict:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
        raise TypeError(f"{where} holds {m!r:.120}; a message is a dict with string 'role' and 'content'")
    return m


def check_prompt(value):
    """reset's value: None (the dataset's prompt), a prompt string, or a non-empty list of chat messages."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise TypeError(f"reset returned {value!r:.120}; return a list of chat messages, a prompt string or None")
    return [_message(m, "reset's list") for m in value]


def check_step(value) -> tuple:
    """step's value: (observation, reward, done) or (observation, reward, done, info), checked."""
    if not isinstance(value, tuple) or len(value) not in (3, 4):
        raise TypeError(f"step returned {value!r:.120}; return (observation, reward, done) or (observation, reward, "
                        "done, info)")  # fmt: skip
    observation, reward, done = value[:3]
    info = value[3] if len(value) == 4 else {}
    if observation is not None:
        if not isinstance(observation, list):
            raise TypeError(f"step's observation is a {type(observation).__name__}; return a list of new chat "
                            "messages or None")  # fmt: skip
        observation = [_message(m, "step's observation") for m in observation]
    reward = _finite(reward, "step's reward")
    if not isinstance(done, bool) and done not in (0, 1):
        raise TypeError(f"step's done is {done!r:.60}; return a bool")
    if not isinstance(info, dict):
        raise TypeError(f"step's info is a {type(info).__name__}; return a dict of floats")
    info = {str(k): _finite(v, f"step's info[{k!r}]") for k, v in info.items()}
    return observation, reward, bool(done), info


def _finite(value, what: str) -> float:
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(f"{what} is {value!r:.60}; return a finite number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}; return a finite number")
    return number
