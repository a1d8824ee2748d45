"""Prompt datasets shipped with megarl, named ``builtin:NAME`` in ``data.train_files`` / ``data.val_files``.

They are generated from a fixed seed (no downloads), so every machine sees the same prompts.

- ``builtin:digits``: the quickstart's toy task (``_digits``).
- ``builtin:dm_math/MODULE[:DIFFICULTY][@SEED]``: DeepMind's mathematics dataset (Saxton et al., ICLR 2019; the
  ``mathematics-dataset`` 1.0.1 generator). MODULE is the generator's ``AREA__NAME`` (``arithmetic__add_or_sub``,
  ``arithmetic__mul``, ``algebra__linear_1d``, ...; an unknown one is refused with the list); DIFFICULTY is
  ``easy``, ``medium`` or ``hard`` (the thirds of the generator's training entropy range, its ``train-easy`` ...)
  or ``any`` (the whole range), default ``easy``; SEED (default 0) picks the draw. ``DM_MATH_SIZES`` questions per
  split (over the generator's length limits skipped, as its generate.py does), each a chat prompt asking for the
  final answer alone (the ``math`` reward checks it with Math-Verify); validation questions never appear in training
  (drawn with another seed, repeats of training questions skipped). The same in every process
  (``megarl.compat.dm_math``); ``*_composed`` modules are refused (they are not).
"""

from __future__ import annotations

import functools
import random


def _digits(split: str) -> list[dict]:
    """The quickstart's verifiable toy task: copy the digit named in the prompt ("copy 7:" -> "7").

    Scored by ``megarl.rewards.toy.toy_digits`` (partial credit for answering with digits at all), so a tiny random
    model has a dense, learnable signal."""
    rng = random.Random({"train": 0, "val": 1}[split])
    verbs = ("copy", "echo", "say", "repeat")
    records = []
    for _ in range({"train": 2048, "val": 64}[split]):
        digit = str(rng.randrange(10))
        records.append({"prompt": f"{rng.choice(verbs)} {digit}:", "answer": digit})
    return records


DM_MATH_SIZES = {"train": 2048, "val": 128}
"""Questions per split of a ``builtin:dm_math/...`` dataset."""
DM_MATH_DIFFICULTY = {"easy": (0, 3), "medium": (1, 3), "hard": (2, 3), "any": (0, 1)}
"""difficulty -> (level, levels): the level-th of ``levels`` equal parts of the generator's training entropy."""
DM_MATH_INSTRUCTION = "Reply with the final answer only."
"""Appended to every question: the answer format the reward parses."""


def _dm_math(name: str, split: str) -> list[dict]:
    """``builtin:dm_math/MODULE[:DIFFICULTY][@SEED]`` (see the module docstring)."""
    rest, _, seed = name.partition("@")
    module, _, difficulty = rest.partition(":")
    difficulty = difficulty or "easy"
    if difficulty not in DM_MATH_DIFFICULTY:
        raise ValueError(f"builtin:dm_math/{name}: difficulty must be one of {sorted(DM_MATH_DIFFICULTY)}")
    if seed and not seed.isdigit():
        raise ValueError(f"builtin:dm_math/{name}: the seed after @ must be a non-negative integer")
    chat = lambda question: [{"role": "user", "content": f"{question} {DM_MATH_INSTRUCTION}"}]  # noqa: E731
    return [{"prompt": chat(q), "answer": a} for q, a in _dm_math_splits(module, difficulty, int(seed or 0))[split]]


@functools.lru_cache(maxsize=4)
def _dm_math_splits(module: str, difficulty: str, seed: int) -> dict[str, list[tuple[str, str]]]:
    """{'train': ..., 'val': ...} (question, answer) pairs; validation drawn with its own seed, training's questions
    left out."""
    from megarl.compat.dm_math import modules  # here: the generator (sympy) loads only for a dm_math task

    level, levels = DM_MATH_DIFFICULTY[difficulty]
    lower, upper = level / levels, (level + 1) / levels
    generators = modules().train(lambda r: (r[0] + lower * (r[1] - r[0]), r[0] + upper * (r[1] - r[0])))
    flat = {f"{area}__{k}": fn for area, fns in generators.items() for k, fn in fns.items() if callable(fn)}
    if module not in flat:
        raise ValueError(f"unknown dm_math module {module!r}; choose one of {sorted(flat)}")
    if "composed" in module:  # composition orders a set of objects by address: another draw in every process
        raise ValueError(f"dm_math module {module!r}: composed modules draw differently in every process; use one "
                         "without '_composed'")  # fmt: skip
    train = _draw(flat[module], DM_MATH_SIZES["train"], 2 * seed, exclude=set())
    val = _draw(flat[module], DM_MATH_SIZES["val"], 2 * seed + 1, exclude=train)
    return {"train": list(train.items()), "val": list(val.items())}


def _draw(generate, count: int, seed: int, exclude) -> dict:
    """``count`` distinct (question -> answer) pairs from ``generate``, none of them in ``exclude``, in draw order."""
    from mathematics_dataset import generate_settings as limits

    from megarl.compat.dm_math import seeded  # as above

    drawn = {}
    with seeded(seed):
        for _ in range(50 * count):
            problem = generate()
            question, answer = str(problem.question), str(problem.answer)
            if len(question) > limits.MAX_QUESTION_LENGTH or len(answer) > limits.MAX_ANSWER_LENGTH:
                continue  # the generator's own filter (its generate.py)
            if question not in exclude and question not in drawn:
                drawn[question] = answer
            if len(drawn) == count:
                return drawn
    raise ValueError(f"the generator gave fewer than {count} distinct questions in {50 * count} draws")


BUILTIN_DATASETS = {"digits": _digits}
"""name -> records(split) for split in {'train', 'val'}; ``dm_math/...`` names are parsed by ``_dm_math``."""

PREFIX = "builtin:"


def builtin_records(spec: str, split: str) -> list[dict]:
    """Records of ``builtin:NAME`` (``split`` is 'train' or 'val'); ValueError naming the choices otherwise."""
    name = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    if name.startswith("dm_math/"):
        return _dm_math(name[len("dm_math/") :], split)
    if name not in BUILTIN_DATASETS:
        choices = [PREFIX + n for n in BUILTIN_DATASETS] + [PREFIX + "dm_math/MODULE[:DIFFICULTY][@SEED]"]
        raise ValueError(f"unknown built-in dataset {spec!r}; choose one of {choices}")
    return BUILTIN_DATASETS[name](split)
