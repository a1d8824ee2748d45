"""Rank 0's metrics sinks: a tqdm progress bar, one console line per step, metrics.jsonl, W&B, and the reward
curve at the end. Other ranks hold a disabled tracker that does nothing."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

from megarl.config.schema import LoggingConfig
from megarl.logging.jsonl import JsonlWriter
from megarl.logging.plot import METRICS_FILE, plot_from_dir
from megarl.logging.wandb_run import finish_wandb, start_wandb

CONSOLE = (
    ("reward/mean", "reward", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/pg_loss", "pg_loss", "{:.4f}"),
    ("kl/ref_mean", "kl", "{:.4f}"),
    ("critic/vf_loss", "vf_loss", "{:.4f}"),
    ("actor/grad_norm", "grad_norm", "{:.3f}"),
    ("val/reward/mean", "val_reward", "{:.3f}"),
)
"""(metric, console label, format) of the per-step line, in order."""


class Tracker:
    def __init__(self, cfg: LoggingConfig, output_dir: str, *, run_config: dict, total_steps: int, enabled: bool,
                 run_id: str | None = None, start_step: int = 0, log_every: int = 1):  # fmt: skip
        self.enabled, self.output_dir, self.total_steps, self.log_every = enabled, output_dir, total_steps, log_every
        self.jsonl = self.wandb = self.bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.jsonl = JsonlWriter(os.path.join(output_dir, METRICS_FILE))
        self.wandb = start_wandb(cfg.wandb, output_dir, run_config, run_id)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="rl", file=sys.stderr, disable=not cfg.progress_bar,
                        dynamic_ncols=True)  # fmt: skip

    @property
    def run_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def write_text(self, name: str, text: str) -> None:
        if self.enabled:
            with open(os.path.join(self.output_dir, name), "w") as f:
                f.write(text)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(step, metrics)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        self.bar.update(1 if step > 0 else 0)  # step 0: the validation before training
        self.bar.set_postfix(
            reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
            len=f"{metrics.get('response_length/mean', float('nan')):.1f}",
            step_s=f"{metrics.get('timing/step', float('nan')):.2f}",
        )
        if step % self.log_every == 0 or step == self.total_steps:
            parts = [f"{label} {fmt.format(metrics[k])}" for k, label, fmt in CONSOLE if k in metrics]
            took = f" {metrics['timing/step']:.2f}s" if "timing/step" in metrics else ""  # step 0: validation only
            self.bar.write(f"[megarl] step {step}/{self.total_steps} " + " ".join(parts) + took, file=sys.stdout)
            sys.stdout.flush()

    def finish(self, summary_lines: list[str] | None = None, exit_code: int = 0) -> str | None:
        """Close everything; on success draw the reward curve and print the summary. Returns the PNG path."""
        if not self.enabled or self.jsonl is None:
            return None
        self.bar.close()
        self.jsonl.close()
        self.jsonl = None
        png = None
        if exit_code == 0:
            png = plot_from_dir(self.output_dir)
            for line in summary_lines or []:
                print(f"[megarl] {line}")
            where = f"metrics: {os.path.join(self.output_dir, METRICS_FILE)}, curve: {png}"
            if self.wandb is not None:
                where += f", W&B run: {self.wandb.dir}"
            print(f"[megarl] {where}", flush=True)
        if self.wandb is not None:
            finish_wandb(self.wandb, exit_code)
        return png

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.finish(exit_code=0 if exc_type is None else 1)
        return False
