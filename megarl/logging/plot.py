"""The reward curve (matplotlib, Agg, no pyplot global state): reward/mean per step, a 10-step moving average, and
val/reward/mean when present."""

from __future__ import annotations

import os
import statistics

from megarl.logging.jsonl import read_metrics

METRICS_FILE = "metrics.jsonl"
PNG_FILE = "reward_curve.png"


def first_and_last(rewards: list[float], window: int = 10) -> tuple[str, float, float]:
    """The mean reward over the first and over the last ``window`` steps (half the run when shorter: the two do not
    overlap), with the span's label ('5 steps'). ``rewards`` must not be empty."""
    k = min(window, max(1, len(rewards) // 2))
    return f"{k} step{'s' if k > 1 else ''}", statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


def plot_reward_curve(rows: list[dict], out_png: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    steps, rewards = [s for s, _ in points], [v for _, v in points]
    fig = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, rewards, "o", ms=3, alpha=0.45, label="reward/mean")
    window = 10
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
              for i in range(len(rewards))]  # fmt: skip
    ax.plot(steps, smooth, "-", lw=2, label=f"{window}-step mean")
    val = [(r["step"], r["val/reward/mean"]) for r in rows if r.get("val/reward/mean") is not None]
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "s--", label="val/reward/mean")
    if rewards:
        span, first, last = first_and_last(rewards, window)
        ax.set_title(f"reward: first {span} {first:.3f}, last {span} {last:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def plot_from_dir(output_dir: str, out_png: str | None = None) -> str:
    """Redraw the curve of a run directory from its metrics.jsonl."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in {output_dir}: not a megarl run directory (trainer.output_dir)")
    return plot_reward_curve(read_metrics(path), out_png or os.path.join(output_dir, PNG_FILE))
