"""Bad input fails before launch, in one line naming the key (or file) and the fix, exit 2, nothing written: through
`megarl train` (its pre-spawn check, the same as --dry-run) and `megarl launch` (paths the launch host cannot see
are warnings there). Then, through real one-rank runs: a rollback moves the abandoned branch aside, and a stop
during the last step completes the run."""

import json
import os
import subprocess
import sys

import pytest

from megarl.cli import main as megarl_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def _train(capsys, tiny_llama_dir, out, *overrides, recipe=QUICKSTART):
    rc = megarl_main(["train", recipe, f"model.path={tiny_llama_dir}", f"trainer.output_dir={out}", *overrides])
    return rc, *capsys.readouterr()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.val_sampling.max_new_tokens=500"],
         "rollout.val_sampling.max_new_tokens=500 leaves no room for a prompt within rollout.max_model_len=64; "
         "raise max_model_len or lower max_new_tokens"),
        (["data.val_batch_size=65", "trainer.val_every=0"],
         "data.val_batch_size=65 exceeds the 64 records of data.val_files; lower it (0 = all of them)"),
        (["data.train_batch_size=4096"], "data.train_batch_size=4096 exceeds the 2048 records of data.train_files"),
        (["actor.optim.lr=inf"], "actor.optim.lr: must be a finite number, got inf"),
        (["actor.optim.adam_beta1=nan"], "actor.optim.adam_beta1: must be a finite number, got nan"),
        (["actor.optim.adam_beta2=1.0"], "actor.optim.adam_beta2: must be in [0, 1), got 1.0"),
        (["actor.optim.adam_eps=0"], "actor.optim.adam_eps: must be > 0, got 0"),
        (["rollout.sampling.temperature=inf"], "rollout.sampling.temperature: must be a finite number, got inf"),
        (["trainer.seed=-1"], "trainer.seed: must be >= 0, got -1"),
        (["rollout.val_sampling.seed=-3"], "rollout.val_sampling.seed: must be >= 0, got -3"),
        (["data.check=sometimes"], "data.check: must be 'full' (every record), 'first:N'"),
    ],
)  # fmt: skip
def test_bad_config_values_fail_before_launch_in_one_line(capsys, tiny_llama_dir, tmp_path, overrides, message):
    out = tmp_path / "out"
    rc, stdout, stderr = _train(capsys, tiny_llama_dir, out, *overrides)
    assert rc == 2 and stdout == "", stdout
    assert stderr.startswith("megarl: config error: ") and len(stderr.strip().splitlines()) == 1, stderr
    assert message in stderr, stderr
    assert not out.exists()


def test_a_yaml_syntax_error_is_file_line_column(capsys, tiny_llama_dir, tmp_path):
    recipe = tmp_path / "tabbed.yaml"
    recipe.write_text(f"base: {QUICKSTART}\ntrainer:\n\ttotal_steps: 3\n")
    rc, _, stderr = _train(capsys, tiny_llama_dir, tmp_path / "out", recipe=str(recipe))
    assert rc == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.strip() == (
        f"megarl: config error: {recipe}:3:1: found character '\\t' that cannot start any token; indent with spaces "
        "(YAML forbids tabs)"
    )
    assert not (tmp_path / "out").exists()


def test_a_malformed_record_is_named_by_file_and_line_before_launch(capsys, tiny_llama_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "copy 1:", "answer": "1"}\n' * 3 + '{"prompt": "copy 2:", "answer": 2\n')
    args = [f"data.train_files=[{data}]", "data.val_files=[]", "trainer.val_every=0", "data.train_batch_size=2",
            "actor.global_batch_size=16"]
    rc, _, stderr = _train(capsys, tiny_llama_dir, tmp_path / "out", *args)
    assert rc == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert f"megarl: config error: data: {data}:4: not a JSON object (" in stderr
    assert "write one JSON object per line" in stderr and not (tmp_path / "out").exists()


def _launch(capsys, *argv):
    rc = megarl_main(["launch", *argv])
    return rc, *capsys.readouterr()


SLURM = ["--nodes", "1", "--gpus-per-node", "2"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward.function=missing_reward.py:score"], "reward.function: reward file not found: missing_reward.py"),
        (["model.path=no/such/model"], "model.path: "),
        (["data.train_files=[no/such/train.jsonl]"], "data: data file not found: no/such/train.jsonl"),
        (["rollout.tp=4"], "rollout.tp=4 does not divide the world size 2"),
        (["rollout.val_sampling.max_new_tokens=500"], "rollout.val_sampling.max_new_tokens=500 leaves no room"),
    ],
)
def test_launch_refuses_what_train_would_refuse(capsys, tiny_llama_dir, tmp_path, overrides, message):
    recipe = [QUICKSTART, f"model.path={tiny_llama_dir}", *overrides]
    rc, stdout, stderr = _launch(capsys, "slurm", *recipe, *SLURM, "--output", str(tmp_path / "logs"))
    assert rc == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("megarl: launch slurm: config error: ") and message in stderr, stderr
    node = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "localhost", "--dry-run"]
    rc, stdout, stderr = _launch(capsys, "torchrun", *recipe, *node)
    assert rc == 2 and stdout == "" and message in stderr, stderr


def test_launch_warns_about_paths_this_host_cannot_see(capsys, tmp_path):
    recipe = os.path.join(REPO, "configs", "llama2_70b_ppo_tp4pp8dp2.yaml")
    args = [recipe, "--nodes", "8", "--gpus-per-node", "8", "--output", str(tmp_path / "logs")]
    rc, stdout, stderr = _launch(capsys, "slurm", *args)
    assert rc == 0 and stdout.startswith("#!/bin/bash\n"), stderr
    warning, lead = stderr.strip().splitlines()
    assert warning == (
        "megarl: launch slurm: warning: /data/rlhf/train.parquet is not visible on this host (no /data here): not "
        "checked; the nodes must see it (--strict-paths makes this an error)"
    )
    assert lead.startswith("[megarl] SIGUSR1 lead (--signal-secs): 357 s = max(300, an update in progress"), lead
    rc, stdout, stderr = _launch(capsys, "slurm", *args, "--strict-paths")
    assert rc == 2 and stdout == "" and "data file not found: /data/rlhf/train.parquet" in stderr


def test_sbatch_values_are_checked_and_env_values_stay_out_of_the_script(capsys, tiny_llama_dir, tmp_path):
    args = [QUICKSTART, f"model.path={tiny_llama_dir}", *SLURM, "--output", str(tmp_path / "logs")]
    rc, stdout, stderr = _launch(capsys, "slurm", *args, "--partition", "gpu\n#SBATCH --uid=0")
    assert rc == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, stderr
    assert "--partition 'gpu\\n#SBATCH --uid=0': an #SBATCH value cannot be empty or hold whitespace" in stderr
    for option in ("--account", "--time"):
        assert _launch(capsys, "slurm", *args, option, "a b")[0] == 2
    rc, stdout, stderr = _launch(capsys, "slurm", *args, "--env", "WANDB_API_KEY=secret")
    assert rc == 0 and "secret" not in stdout and ': "${WANDB_API_KEY?' in stdout
    assert "export WANDB_API_KEY before sbatch" in stderr
    check = subprocess.run(["bash", "-n"], input=stdout, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


# --- real runs: rollback, and a stop during the last step -------------------------------------------------------
def _run(model, out, *extra, fault=None):
    cmd = [sys.executable, "-m", "megarl.cli", "train", QUICKSTART, f"model.path={model}", f"trainer.output_dir={out}",
           "actor.parallel.tp=1", "rollout.backend=hf", "trainer.val_every=0", "logging.wandb.mode=disabled",
           "logging.progress_bar=false", "data.train_batch_size=2", "rollout.sampling.n=4",
           "actor.global_batch_size=8", "rollout.sampling.max_new_tokens=4", "trainer.save_every=1",
           "trainer.keep_last=2", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    env.pop("MEGARL_FAULT", None)
    if fault:
        env["MEGARL_FAULT"] = fault
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _iters(root) -> list[str]:
    return sorted(p.name for p in root.glob("iter_*"))


def test_rollback_keeps_the_new_branch_and_a_stop_in_the_last_step_completes_the_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    ckpts = out / "checkpoints"
    first = _run(tiny_llama_dir, out, "trainer.total_steps=4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _iters(ckpts) == ["iter_0000003", "iter_0000004"]
    # roll back to step 3 and train to 5: the old iter_4 is another branch
    back = _run(tiny_llama_dir, out, "trainer.total_steps=5", f"trainer.resume={ckpts / 'iter_0000003'}")
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    assert f"rolled back to step 3: moved the 1 later checkpoint(s) of the abandoned branch to {ckpts}/abandoned" in (
        back.stdout
    )
    assert _iters(ckpts) == ["iter_0000004", "iter_0000005"]  # keep_last=2 kept the new branch
    assert _iters(ckpts / "abandoned") == ["iter_0000004"]
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    # resume=auto follows the new branch; SIGTERM during the last step's update: saved, exit 0, no STOPPED
    last = _run(tiny_llama_dir, out, "trainer.total_steps=6", fault="sigterm_update@6")
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    assert f"resuming from {ckpts}/iter_0000005 (step 5;" in last.stdout
    assert "SIGTERM during the last step: saved; the run is complete" in last.stdout
    assert (ckpts / "iter_0000006" / "manifest.json").is_file() and not (out / "STOPPED").exists()
