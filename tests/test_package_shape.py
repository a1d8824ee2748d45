"""The package keeps the shape of the recut (``tests/package_shape.py`` reads it with ``ast``): no import cycle
between modules, the subpackages layered, no function over 60 lines, one RL step for every async mode, and the
imports of megarl's own modules inside functions no more than today's (each has a reason: an optional or heavy
dependency at that point, a command loaded only when it runs)."""

import ast

from tests.package_shape import LONG, cycles, read_shape

INNER_IMPORTS = 28
"""Today's count; lower it when one goes, never raise it without a reason the import's comment gives."""


def test_modules_and_subpackages_import_without_a_cycle():
    shape = read_shape()
    assert cycles(shape.imports) == []
    assert cycles(shape.package_imports()) == []


def test_no_function_is_longer_than_a_screen():
    assert read_shape().long == [], f"functions over {LONG} lines"


def test_the_rl_step_has_no_branch_on_the_async_mode():
    step = read_shape().functions["megarl.rl.step.rl_step"]
    tests = [ast.unparse(n.test) for n in ast.walk(step) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    assert tests and not [t for t in tests if "async" in t or "bounded" in t or "one_step_off" in t], tests
    assert step.end_lineno - step.lineno + 1 <= 30


def test_imports_inside_functions_do_not_grow():
    assert len(read_shape().inner) <= INNER_IMPORTS
