"""Training checkpoints without a process group: the manifest (sizes, SHA-256, written last), which checkpoint
`resume=auto` picks, `plan_start`'s refusals, fault-injection parsing, and bad input to the conversion tools, each
refused with one message before anything is written."""

import json
import os
import shutil

import pytest

from megarl import faults
from megarl.checkpoint import format as ckpt
from megarl.checkpoint.locate import find_resume
from megarl.checkpoint.manifest import MANIFEST, ManifestError, verify_manifest, write_manifest
from megarl.config import load_config
from megarl.config.validate import validate
from megarl.convert.cli import hf_to_megatron_main, megatron_to_hf_main
from megarl.models.spec import read_hf_config
from megarl.run.resume import ResumeError, RunComplete, plan_start, set_aside_previous_run


def _iteration(root, step, files=None, manifest=True):
    d = root / f"iter_{step:07d}"
    d.mkdir(parents=True)
    for name, data in (files or {"__0_0.distcp": b"x" * 1000, "common.pt": b"common", "metadata.json": b"{}"}).items():
        (d / name).write_bytes(data)
    if manifest:
        write_manifest(str(d))
    return d


def test_manifest_refuses_a_flipped_byte_naming_the_file(tmp_path):
    d = _iteration(tmp_path, 2)
    verify_manifest(str(d))
    shard = d / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[500] ^= 0x01
    shard.write_bytes(bytes(data))
    verify_manifest(str(d), hashes=False)  # same size: only the hash sees it
    with pytest.raises(ManifestError, match=r"__0_0\.distcp does not match its SHA-256"):
        verify_manifest(str(d))


def test_manifest_refuses_truncated_missing_and_unlisted_damage(tmp_path):
    d = _iteration(tmp_path, 2)
    (d / "common.pt").write_bytes(b"comm")
    with pytest.raises(ManifestError, match=r"common\.pt has 4 bytes, the manifest says 6"):
        verify_manifest(str(d), hashes=False)
    (d / "common.pt").unlink()
    with pytest.raises(ManifestError, match=r"common\.pt is missing"):
        verify_manifest(str(d))
    (d / MANIFEST).write_text("{not json")
    with pytest.raises(ManifestError, match="is damaged"):
        verify_manifest(str(d))


def test_auto_resume_skips_a_checkpoint_without_manifest_and_says_so(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _iteration(root, 2)
    _iteration(root, 4, manifest=False)  # killed mid-save
    (root / "iter_0000006.tmp").mkdir()  # an interrupted save is never a candidate
    found = find_resume(str(tmp_path / "run"))
    assert found.step == 2 and found.path.endswith("iter_0000002")
    assert len(found.skipped) == 1 and "iter_0000004 has no manifest.json" in found.skipped[0]


def test_every_moment_of_a_publish_leaves_the_newest_checkpoint_findable_and_finishable(tmp_path):
    """The states a kill can leave between a save's manifest and its cleanup (``training._publish``: the older
    iter_N renamed aside, the new one renamed in, the older deleted): ``resume=auto`` finds step 4's checkpoint in
    each, and ``finish_interrupted_saves`` leaves a published iter_0000004 and ``latest`` naming it; a save cut before
    its manifest is left for the tidy-up and the older one kept."""
    from megarl.checkpoint.locate import REPLACED_SUFFIX, finish_interrupted_saves

    def state(name, *dirs):
        root = tmp_path / name / "checkpoints"
        _iteration(root, 2)
        for d, complete in dirs:
            made = _iteration(tmp_path / name / "staging" / d, 4, files={"common.pt": d.encode()}, manifest=complete)
            made.rename(root / d)
        return root

    cases = {
        "cut_before_the_renames": [("iter_0000004.tmp", True)],  # no older iter_4: the first save of step 4
        "the_older_set_aside": [("iter_0000004" + REPLACED_SUFFIX, True), ("iter_0000004.tmp", True)],
        "renamed_in": [("iter_0000004" + REPLACED_SUFFIX, True), ("iter_0000004", True)],
        "before_the_older_is_set_aside": [("iter_0000004", True), ("iter_0000004.tmp", True)],
    }
    for name, dirs in cases.items():
        root = state(name, *dirs)
        (root / "latest").write_text("iter_0000002\n")  # the kill came before latest was rewritten
        found = find_resume(str(root.parent))
        assert found.step == 4, (name, found)
        finish_interrupted_saves(str(root))
        assert (root / "iter_0000004" / MANIFEST).is_file(), name
        assert find_resume(str(root.parent)).path == str(root / "iter_0000004"), name
        assert (root / "latest").read_text() == "iter_0000004\n", name
        if name in ("cut_before_the_renames", "the_older_set_aside"):  # the new save was finished
            assert (root / "iter_0000004" / "common.pt").read_text() == "iter_0000004.tmp"
    root = state("cut_before_the_manifest", ("iter_0000004.tmp", False))
    assert find_resume(str(root.parent)).step == 2 and finish_interrupted_saves(str(root)) == []


def test_a_foreign_file_in_output_dir_refuses_the_set_aside_and_moves_nothing(cfg_for, tmp_path):
    """A run that never completed a step would be set aside: with a file megarl did not write beside it (a user's
    recipe, data, the source tree with output_dir=.) the start is refused in one line and nothing moves."""
    cfg, spec = cfg_for()
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    (out / "my_recipe.yaml").write_text("mine")
    before = sorted(os.listdir(out))
    with pytest.raises(ResumeError, match=r"also files megarl did not write \(my_recipe\.yaml\): nothing was moved"):
        plan_start(cfg, spec)
    assert sorted(os.listdir(out)) == before and (out / "my_recipe.yaml").read_text() == "mine"
    (out / "my_recipe.yaml").unlink()
    assert plan_start(cfg, spec) is None  # only megarl's files: set aside by the start


@pytest.fixture
def cfg_for(tiny_llama_dir, tmp_path):
    def make(*overrides):
        cfg = load_config(
            "configs/quickstart.yaml",
            [f"model.path={tiny_llama_dir}", f"trainer.output_dir={tmp_path / 'out'}", "trainer.total_steps=6",
             *overrides],
        )  # fmt: skip
        return cfg, validate(cfg)

    return make


def _fake_training_checkpoint(out, hf_config, step=2):
    root = out / "checkpoints"
    _iteration(root, step)
    ckpt.write_meta(str(root), {"family": "llama", "hf_config": hf_config})
    return root


def test_plan_start_fresh_resume_and_refusals(cfg_for, tiny_llama_dir, tmp_path):
    cfg, spec = cfg_for()
    assert plan_start(cfg, spec) is None  # empty output_dir: a fresh start
    out = tmp_path / "out"
    (out / "metrics.jsonl").write_text("")
    (out / "config.yaml").write_text("")
    assert plan_start(cfg, spec) is None  # a run that never completed a step starts over (build_job sets it aside)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')  # the last line cut by a kill
    with pytest.raises(ResumeError, match="holds a previous run that completed step 2 but no complete checkpoint"):
        plan_start(cfg, spec)
    with pytest.raises(RunComplete, match="completed its step 2 = trainer.total_steps: the run is complete"):
        plan_start(cfg_for("trainer.total_steps=2")[0], spec)  # no checkpoint (save_every=0), every step done
    never, _ = cfg_for("trainer.resume=never")
    with pytest.raises(ResumeError, match="trainer.overwrite=true"):
        plan_start(never, spec)
    assert plan_start(cfg_for("trainer.resume=never", "trainer.overwrite=true")[0], spec) is None
    root = _fake_training_checkpoint(out, read_hf_config(tiny_llama_dir))
    found = plan_start(cfg, spec)
    assert found.step == 2 and found.path == str(root / "iter_0000002")
    with pytest.raises(RunComplete, match="the run is complete, nothing to do"):
        plan_start(cfg_for("trainer.total_steps=2")[0], spec)
    with pytest.raises(ResumeError, match="nothing left to run"):  # an explicit checkpoint: not this run's end
        plan_start(cfg_for("trainer.total_steps=2", f"trainer.resume={root / 'iter_0000002'}")[0], spec)
    with pytest.raises(ResumeError, match="no complete iter_N checkpoint"):
        plan_start(cfg_for(f"trainer.resume={tmp_path / 'nowhere'}")[0], spec)
    assert plan_start(cfg_for(f"trainer.resume={root / 'iter_0000002'}")[0], spec).step == 2


def test_resuming_a_checkpoint_of_another_model_is_refused(cfg_for, tiny_llama_dir, tmp_path):
    cfg, spec = cfg_for()
    other = {**read_hf_config(tiny_llama_dir), "num_hidden_layers": 4}
    _fake_training_checkpoint(tmp_path / "out", other)
    with pytest.raises(ResumeError, match=r"different model than model.path: num_layers 4 \(checkpoint\) vs 2"):
        plan_start(cfg, spec)


def test_an_unwritable_output_dir_is_refused(cfg_for, tmp_path):
    (tmp_path / "a_file").write_text("")
    cfg, spec = cfg_for(f"trainer.output_dir={tmp_path / 'a_file' / 'run'}")
    with pytest.raises(ResumeError, match="is not writable"):
        plan_start(cfg, spec)


def test_fault_injection_spec_is_parsed_strictly(monkeypatch):
    monkeypatch.setenv(faults.ENV, "generate@5,nan_loss@2")
    assert faults.planned() == {"generate": 5, "nan_loss": 2} and faults.at("generate", 5)
    monkeypatch.setenv(faults.ENV, "explode@1")
    with pytest.raises(ValueError, match="expected <point>@<step>"):
        faults.planned()


def _listing(path):
    return sorted(os.listdir(path)) if os.path.exists(path) else None


def test_hf_to_megatron_refuses_a_tp_that_does_not_divide_the_heads_before_spawning(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert hf_to_megatron_main(["--hf-dir", tiny_llama_dir, "--out", str(out), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp=3 does not divide the model's 4 attention heads, 2 key/value heads" in err
    assert "use a tp in [1, 2]" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "ckpt.tmp").exists()


def test_hf_to_megatron_names_a_truncated_safetensors_file(tiny_llama_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama_dir, hf)
    weights = next(hf.glob("*.safetensors"))
    before = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(before // 2)
    assert hf_to_megatron_main(["--hf-dir", str(hf), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert f"{weights} is not a readable safetensors file" in err and "truncated or damaged" in err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


def test_a_damaged_latest_is_refused_naming_it(tmp_path, capsys):
    root = tmp_path / "ckpt"
    _iteration(root, 3)
    ckpt.write_meta(str(root), {"family": "llama", "hf_config": {}})
    (root / "latest").write_bytes(b"\x00\xffgarbage")
    before = _listing(root)
    assert megatron_to_hf_main(["--ckpt", str(root), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{root / 'latest'} is damaged" in err and "iter_0000003" in err
    assert _listing(root) == before and not (tmp_path / "hf").exists()
    assert json.loads((root / "iter_0000003" / MANIFEST).read_text())["files"]  # nothing lost


def test_a_run_that_never_completed_a_step_is_set_aside_but_the_slurm_logs_stay(tmp_path):
    out = tmp_path / "out"
    (out / "engine").mkdir(parents=True)
    (out / "slurm").mkdir()
    (out / "slurm" / "job.out").write_text("live")
    (out / "config.yaml").write_text("x")
    (out / "metrics.jsonl").write_text("")
    aside = set_aside_previous_run(str(out))
    assert sorted(os.listdir(out)) == sorted(["slurm", os.path.basename(aside)])
    assert sorted(os.listdir(aside)) == ["config.yaml", "engine", "metrics.jsonl"]
    assert (out / "slurm" / "job.out").read_text() == "live"
