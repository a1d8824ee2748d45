"""Run under torchrun by tests/test_rl_e2e.py: several short RL jobs, one after another, on ONE colocated vLLM
engine (starting an engine costs 10-40 s here; every job syncs its own initial actor into it as version 0).

    torchrun --standalone --nproc-per-node 2 tests/rl_e2e_worker.py '<json args>'
"""

from __future__ import annotations

import json
import os
import sys

import psutil

from megarl.config import load_config, validate
from megarl.models.source import model_source
from megarl.run.train import train


def _reward_workers() -> list[int]:
    """This rank's reward worker processes still alive."""
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "megarl.rewards.worker" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.Error:
            pass
    return alive


def main(args: dict) -> None:
    engines = {}  # one per backend (jobs of one backend share its engine: the same rollout.max_model_len)
    for name, recipe, overrides, env in args["jobs"]:  # a job's own model.path (a checkpoint of the same model) wins
        cfg = load_config(
            recipe, [f"model.path={args['hf_dir']}", f"trainer.output_dir={args['out']}/{name}", *overrides]
        )
        spec = validate(cfg, world_size=2)
        os.environ.update(env)  # fault injection for this job only
        backend = cfg.rollout.backend
        try:
            engines[backend] = train(cfg, spec, model_source(cfg.model.path), engine=engines.get(backend)).engine
        except FloatingPointError as e:  # expected by a job that must stop (the last one: the engine is kept)
            with open(os.path.join(args["out"], name, "error.txt"), "w") as f:
                f.write(str(e))
        finally:
            for key in env:
                os.environ.pop(key)
        with open(os.path.join(args["out"], name, f"reward_workers_left.rank{os.environ['RANK']}"), "w") as f:
            json.dump(_reward_workers(), f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
