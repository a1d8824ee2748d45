"""Environments and tools for tests/test_env.py, used by name (``tests/envs.py:EchoEnv``) in worker processes.

The misbehaving ones misbehave on the episodes whose prompt holds one of the digits in $MEGARL_TEST_BAD_DIGITS
(default "7") and behave like ``EchoEnv`` otherwise."""

import os
import sys
import time


class EchoEnv:
    """Two turns: the observation quotes the first answer (it depends on the action); each turn is rewarded by the
    number of its tokens / 100."""

    def __init__(self, greeting: str = "say"):
        self.greeting, self.turn = greeting, 0

    def reset(self, record):
        return [{"role": "user", "content": f"{self.greeting} {record['prompt']}"}]

    def step(self, text, token_ids):
        self.turn += 1
        if self.turn >= 2:
            return None, len(token_ids) / 100, True, {"quoted": 0.0}
        return [{"role": "user", "content": f"you said {text!r}; again"}], len(token_ids) / 100, False, {"quoted": 1.0}


def _bad(record_or_text) -> bool:
    return any(d in str(record_or_text) for d in os.environ.get("MEGARL_TEST_BAD_DIGITS", "7"))


class _Misbehaving(EchoEnv):
    def reset(self, record):
        self.bad = _bad(record["prompt"])
        return super().reset(record)

    def step(self, text, token_ids):
        if self.bad:
            self.misbehave()
        return super().step(text, token_ids)


class Hangs(_Misbehaving):
    def misbehave(self):
        time.sleep(3600)


class Raises(_Misbehaving):
    def misbehave(self):
        raise RuntimeError("the environment broke")


class Exits(_Misbehaving):
    def misbehave(self):
        sys.exit(3)


class Kills(_Misbehaving):
    def misbehave(self):
        os._exit(9)


class BadObservation(_Misbehaving):
    def step(self, text, token_ids):
        if self.bad:
            return "not a list", 0.0, False
        return super().step(text, token_ids)


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return str(a + b)


def slow(a: int) -> str:
    """Hang when a is 7.

    Args:
        a: A number.
    """
    if a == 7:
        time.sleep(3600)
    return str(a)


def exits(a: int) -> str:
    """Exit when a is 7.

    Args:
        a: A number.
    """
    if a == 7:
        sys.exit(2)
    return str(a)


def dies(a: int) -> str:
    """Kill the process when a is 7.

    Args:
        a: A number.
    """
    if a == 7:
        os._exit(9)
    return str(a)


def raises(a: int) -> str:
    """Raise when a is 7.

    Args:
        a: A number.
    """
    if a == 7:
        raise ValueError("seven")
    return str(a)


def not_a_string(a: int) -> str:
    """Return an int when a is 7.

    Args:
        a: A number.
    """
    return 7 if a == 7 else str(a)


from megarl.env.tools import ToolEnv  # noqa: E402


class AlwaysCalls(ToolEnv):
    """builtin:tools for a random model that never writes a call: its first ``calls`` turns are read as a call to
    ``calculator`` adding the digits the turn holds ("1+1" without any), so episodes have tool results, several
    turns and a tool's observation tokens; the turn after them is the answer."""

    def __init__(self, tools, calls: int = 2, **kwargs):
        super().__init__(tools, **kwargs)
        self.calls, self.turn = calls, 0

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's episode continues: its turns count on (``env/tool_calls`` stays ``calls`` per episode)."""
        super().load_state_dict(state)
        self.resumed = 1.0

    def step(self, text, token_ids):
        self.turn += 1
        if self.turn <= self.calls:
            expression = "+".join(c for c in text if c.isdigit()) or "1+1"
            text = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
        observation, reward, done, info = super().step(text, token_ids)
        return observation, reward, done, {**info, "resumed": getattr(self, "resumed", 0.0)}


class ForgetfulCalls(AlwaysCalls):
    """``AlwaysCalls`` without a ``state_dict``: a resume starts its episodes in flight over."""

    state_dict = None


class HangsOnce(EchoEnv):
    """``EchoEnv`` whose step hangs (for an hour) once, after $MEGARL_TEST_HANG_AFTER steps in the run: each step
    appends a byte to $MEGARL_TEST_MARKER.steps; the one that hangs creates $MEGARL_TEST_MARKER first, and once it
    exists (the run after) nothing hangs. Each step takes ``sleep_s`` (a slow tool: episodes are in flight when the
    weights change). Its ``state_dict`` is None for the prompts with an odd digit (those episodes start over on
    resume: ``env/restarted_on_resume``); the others continue (``env/resumed``)."""

    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.sleep_s, self.odd, self.resumed = sleep_s, False, 0.0

    def reset(self, record):
        self.odd = any(d in str(record["prompt"]) for d in "13579")
        return super().reset(record)

    def state_dict(self):
        return None if self.odd else {"turn": self.turn, "odd": False}

    def load_state_dict(self, state):
        self.turn, self.odd, self.resumed = state["turn"], state["odd"], 1.0

    def step(self, text, token_ids):
        time.sleep(self.sleep_s)
        marker = os.environ["MEGARL_TEST_MARKER"]
        with open(f"{marker}.steps", "a") as f:
            f.write(".")
        if os.path.getsize(f"{marker}.steps") >= int(os.environ.get("MEGARL_TEST_HANG_AFTER", "0")):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, b"hang\n")
                os.close(fd)
                time.sleep(3600)
            except FileExistsError:  # it hung once already
                pass
        observation, reward, done, info = super().step(text, token_ids)
        return observation, reward, done, {**info, "resumed": self.resumed}
