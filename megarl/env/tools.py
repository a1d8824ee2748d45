"""The built-in tool-calling environment (``env.class: builtin:tools``): the model calls the functions of
``env.tools`` in the chat template's format, each call's result comes back as a ``tool`` message, and the episode
ends on an answer without a tool call (scored by ``reward.function``).

A call the parser cannot read (bad JSON, no name, an unknown tool, arguments that do not fit) and a tool that raises
become an error message to the model, counted in ``env/tool_errors``. A tool that hangs, exits or kills its process,
or returns something that is not a string, fails its episode (the environment's worker is isolated: nothing else
is lost)."""

from __future__ import annotations

import json
import re

from transformers.utils import get_json_schema  # here: a worker imports it as it starts, not in a timed call

from megarl.rewards.registry import RewardLoadError, load_named

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more per turn."""


def parse_hermes(text: str) -> list[dict | str]:
    """Each tool call in ``text``: ``{"name", "arguments"}``, or a string saying why it cannot be read."""
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"the tool call is not JSON ({e.msg} at character {e.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('a tool call is {"name": ..., "arguments": {...}}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"the arguments of {call['name']!r} are not a JSON object")
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    if not calls and "<tool_call>" in text:  # opened, never closed
        calls.append("a <tool_call> without its </tool_call>")
    return calls


PARSERS = {"hermes": parse_hermes}
"""``env.tool_parser`` -> text -> calls."""


def load_tools(specs: list[str]) -> dict:
    """name -> function, for each tool spec ('path/to/file.py:fn' or 'package.module:fn')."""
    tools = {}
    for spec in specs:
        fn = load_named(spec, "tool", reuse=True)
        tools[fn.__name__] = fn
    return tools


def tool_schema(fn) -> dict:
    """The tool's JSON schema for the chat template, from its type hints and docstring (transformers')."""
    try:
        return get_json_schema(fn)
    except Exception as e:
        raise RewardLoadError(f"tool {fn.__name__!r}: no schema from its signature ({e}); give every argument a "
                              "type hint and the docstring an 'Args:' line per argument") from None  # fmt: skip


class ToolEnv:
    """One episode of tool calls (see the module's doc). ``max_calls``: tool calls per turn at most."""

    def __init__(self, tools: list[str], parser: str = "hermes", max_calls: int = 8, system: str | None = None):
        self.tool_specs, self.parser, self.max_calls, self.system = list(tools), parser, max_calls, system
        self.tools = None

    @classmethod
    def check(cls, tools: list[str], parser: str = "hermes", **_):
        """A dry run: every tool loads and has a schema."""
        for fn in load_tools(tools).values():
            tool_schema(fn)

    def _functions(self) -> dict:
        if self.tools is None:
            self.tools = load_tools(self.tool_specs)
        return self.tools

    def __getstate__(self):
        return {**self.__dict__, "tools": None}  # functions load again in whichever worker takes the next turn

    def state_dict(self) -> dict:
        """Its attributes (a subclass's too; the tools load again): an episode in flight continues after a resume."""
        return {k: v for k, v in self.__getstate__().items() if k != "tools"}  # what pickles between turns

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)

    def tool_schemas(self) -> list[dict]:
        return [tool_schema(fn) for fn in self._functions().values()]

    def reset(self, record: dict):
        prompt = record["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return ([{"role": "system", "content": self.system}] if self.system else []) + messages

    def step(self, text: str, token_ids: list[int]):
        calls = PARSERS[self.parser](text)
        if not calls:
            return None, 0.0, True, {"tool_calls": 0.0, "tool_errors": 0.0}
        tools, results, errors = self._functions(), [], 0
        for k, call in enumerate(calls):
            if k >= self.max_calls:
                results.append(f"error: at most {self.max_calls} tool calls per turn; this one was not run")
                errors += 1
            elif isinstance(call, str):
                results.append(f"error: {call}")
                errors += 1
            elif call["name"] not in tools:
                results.append(f"error: no tool named {call['name']!r}; the tools are {sorted(tools)}")
                errors += 1
            else:
                try:
                    result = tools[call["name"]](**call["arguments"])
                except Exception as e:  # noqa: BLE001 -- the model's call was wrong: it reads why
                    results.append(f"error: {type(e).__name__}: {e}")
                    errors += 1
                    continue
                if not isinstance(result, str):
                    raise TypeError(f"tool {call['name']!r} returned a {type(result).__name__}; a tool returns a "
                                    "string")  # fmt: skip
                results.append(result)
        observation = [{"role": "tool", "content": r} for r in results]
        return observation, 0.0, False, {"tool_calls": float(len(calls)), "tool_errors": float(errors)}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * / and parentheses.

    Args:
        expression: The expression, e.g. "3 * (4 + 5)".
    """
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.USub: operator.neg}  # fmt: skip

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.operand))
        raise ValueError(f"not an arithmetic expression of integers: {expression!r}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else result)
