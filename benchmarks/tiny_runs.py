"""What the RL benchmarks share: one `megarl train configs/tiny_grpo.yaml` run of a given size, its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_rows(hf_dir: str, out: str, overrides: list[str], *, steps: int, prompts: int, n: int, new_tokens: int,
               env: dict[str, str] | None = None) -> list[dict]:  # fmt: skip
    """Run `steps` + 1 GRPO steps of ``prompts`` x ``n`` samples of at most ``new_tokens`` tokens (no validation, no
    W&B), with ``overrides`` and the extra environment ``env``; the metrics rows after the first (warm-up) step."""
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/tiny_grpo.yaml", f"model.path={hf_dir}",
           f"trainer.output_dir={out}", f"trainer.total_steps={steps + 1}", "trainer.val_every=0",
           "logging.wandb.mode=disabled", "logging.progress_bar=false", f"data.train_batch_size={prompts}",
           f"actor.global_batch_size={prompts * n}", f"rollout.sampling.n={n}",
           f"rollout.sampling.max_new_tokens={new_tokens}", f"rollout.max_model_len={new_tokens + 32}",
           f"actor.seq_length={new_tokens + 32}", "rollout.kv_cache_mb=64", *overrides]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]  # the warm-up step out
