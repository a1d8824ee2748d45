"""DeepMind's ``mathematics_dataset`` 1.0.1 (Saxton et al., ICLR 2019) importable and deterministic here.

- Import: its ``sample/polynomials.py`` does ``from sympy.solvers.diophantine import base_solution_linear``, which
  sympy 1.14 (pinned) moved to ``sympy.solvers.diophantine.diophantine``. ``modules()`` puts the function back under
  its old name before the first import (the function itself is unchanged).
- Symbols: ``Context.pop`` draws a variable name with ``random.choice(list(a_set_of_letters))``, whose order
  follows ``PYTHONHASHSEED`` (different in every process): the same seed gave "Solve ... for t." in one process and
  "... for s." in another. ``modules()`` makes it draw from the letters in sorted order.
- Randomness: its generators draw from the global ``random`` and ``numpy.random`` states. ``seeded(seed)`` seeds both
  for the generation and restores what they were afterwards, so building a dataset changes no other randomness.
"""

from __future__ import annotations

import contextlib
import random


def modules():
    """``mathematics_dataset.modules.modules`` (the areas: algebra, arithmetic, calculus, ...), importable."""
    import importlib

    # the package module itself: the attribute sympy.solvers.diophantine is the function of that name
    package = importlib.import_module("sympy.solvers.diophantine")
    if not hasattr(package, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        package.base_solution_linear = base_solution_linear
    from mathematics_dataset.modules import modules as areas
    from mathematics_dataset.util import composition

    if not getattr(composition.Context.pop, "megarl_patched", False):
        composition.Context.pop = _pop_in_sorted_order
    return areas


def _pop_in_sorted_order(self):
    """``mathematics_dataset.util.composition.Context.pop`` drawing from the unused symbols in sorted order."""
    from mathematics_dataset.util import composition

    allowed = composition._ALLOWED_SYMBOLS - self._relation_symbols - self._self_symbols - self._child_symbols
    if not allowed:
        raise ValueError("Ran out of symbols")
    symbol = random.choice(sorted(allowed))
    self._self_symbols.add(symbol)
    return symbol


_pop_in_sorted_order.megarl_patched = True


@contextlib.contextmanager
def seeded(seed: int):
    """The global ``random`` and ``numpy.random`` states seeded with ``seed`` inside, restored after."""
    import numpy as np

    saved = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
