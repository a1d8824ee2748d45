"""Weights & Biases: online, offline (files under ``<output_dir>/wandb``, upload later with ``wandb sync``) or
disabled (wandb is not even initialised; nothing is written)."""

from __future__ import annotations

import os

from megarl.config.schema import WandbConfig


def start_wandb(cfg: WandbConfig, output_dir: str, run_config: dict, run_id: str | None = None):
    """The W&B run, or None when disabled. ``run_id`` continues an earlier run."""
    if cfg.mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")  # else wandb suggests Weave because vLLM imports openai
    return wandb.init(
        mode=cfg.mode,
        project=cfg.project,
        name=cfg.name or None,
        tags=list(cfg.tags) or None,
        config=run_config,
        dir=output_dir,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_machine_info=True),
    )


def finish_wandb(run, exit_code: int) -> None:
    """End ``run`` with its files complete on disk: ``finish()`` only asks wandb's service to close the run file (a
    reader right after it could see no history rows); ``teardown`` waits for the service."""
    import wandb

    run.finish(exit_code=exit_code)
    wandb.teardown(exit_code=exit_code)
