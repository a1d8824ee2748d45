"""JSON-lines files. metrics.jsonl: one JSON object per step (``{"step": N, ...}``). Non-finite floats are written
as null (JSON has no NaN)."""

from __future__ import annotations

import json
import math
import os

TIMELINE_FILE = "timeline.jsonl"
"""With pools: per step, when each pool learned and generated (``time.monotonic`` spans; the leader writes it)."""
SAMPLES_DIR = "samples"
"""``trainer.save_samples``: one ``step_<N>.jsonl`` per step in it."""


def _clean(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlWriter:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f = open(path, "a")

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list[dict]:
    """A JSON-lines file's rows. Every row written here ends with a newline: a last line without one is a write cut
    short by a kill, and is left out."""
    with open(path) as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def write_rows(path: str, rows: list[dict]) -> None:
    """Replace ``path`` with ``rows`` atomically (a resumed run's metrics.jsonl holds the checkpoint's history, and
    then continues; a step's samples file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
    os.replace(tmp, path)
