"""A SIGKILL at every point of a checkpoint's save and publish (``MEGARL_FAULT``: inside the save, after its
manifest, inside the replace of a step saved again, inside the prune) leaves a checkpoint that the next start finds
and loads, with the weights that were saved, equal tensors; and a damaged newest checkpoint falls back to the
previous one in one line (tests/checkpoint_fault_worker.py runs the real save and load, one rank)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.checkpoint_fault_worker import expected_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    # name: (keep_last, the saves, the fault, the step and variant the next start loads, the iter_N left after it)
    "save": (0, ["2", "4"], "save@4", (2, 0), ["iter_0000002"]),  # killed before step 4's manifest
    "publish": (1, ["2", "4"], "publish@4", (4, 0), ["iter_0000002", "iter_0000004"]),  # manifest, no rename yet
    "replace": (1, ["2", "4", "4:1"], "replace@4", (4, 1), ["iter_0000004"]),  # the older iter_4 set aside
    "prune": (1, ["2", "4"], "prune@4", (4, 0), ["iter_0000004"]),  # iter_2 renamed for deletion, not deleted
}


def _worker(*args, fault=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGARL_FAULT", None)
    if fault:
        env["MEGARL_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "tests.checkpoint_fault_worker", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint-faults")
    roots, killed = {}, {}
    for name, (keep, saves, fault, _, _) in CASES.items():
        roots[name] = str(tmp / name / "checkpoints")
        run = _worker(tiny_llama_dir, "save", roots[name], str(keep), *saves, fault=fault)
        killed[name] = (run.returncode, run.stdout + run.stderr)
    out = tmp / "loaded.pt"
    run = _worker(tiny_llama_dir, "load", str(out), *roots.values())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return roots, killed, torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", list(CASES))
def test_a_kill_at_each_point_of_a_save_leaves_a_checkpoint_that_loads_what_was_saved(loaded, case):
    roots, killed, result = loaded
    rc, out = killed[case]
    point = CASES[case][2].split("@")[0]
    assert rc == -9 and f"fault injection: {point} at step 4" in out, out[-3000:]
    got = result[roots[case]]
    step, variant = CASES[case][3]
    assert got["step"] == step, got
    want = expected_weights(result["initial"], step, variant)
    assert want.keys() == got["weights"].keys()
    assert [n for n in want if not torch.equal(want[n], got["weights"][n])] == []
    assert got["left"] == CASES[case][4], got["left"]
    if case in ("publish", "replace"):  # the start finished the publish the kill cut
        assert got["finished"] and "finished an interrupted save" in got["finished"][0]


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_in_one_line(loaded, tiny_llama_dir, tmp_path):
    """After the publish case's start: a flipped byte in iter_0000004 (same size: only its SHA-256 sees it) ->
    the start takes iter_0000002, says so in one line and keeps the damaged one in checkpoints/damaged/; then a
    truncated file in iter_0000002 -> no checkpoint left, said likewise."""
    roots, _, _ = loaded
    out = tmp_path / "damaged.pt"
    run = _worker(tiny_llama_dir, "damaged", str(out), os.path.dirname(roots["publish"]))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    flip, truncate = torch.load(out, weights_only=False)
    assert flip["damaged"].endswith("iter_0000004") and flip["step"] == 2 and flip["aside"] == ["iter_0000004"]
    line = next(n for n in flip["notes"] if "is damaged" in n)
    assert "\n" not in line and "does not match its SHA-256" in line and "resuming from" in line, line
    assert line.endswith("iter_0000002 instead") and "moved to " in line and "/damaged/iter_0000004" in line
    assert truncate["damaged"].endswith("iter_0000002") and truncate["step"] is None
    line = next(n for n in truncate["notes"] if "is damaged" in n)
    assert "bytes, the manifest says" in line and line.endswith("no older checkpoint: starting over"), line
    assert truncate["aside"] == ["iter_0000002", "iter_0000004"]
