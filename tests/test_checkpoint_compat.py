"""megarl/compat/megatron_fixes.py's distributed-optimizer checkpoint workarounds (megatron-core 0.16, torch Adam):
each bug shows with its workaround off, and with all of them on a saved and reloaded optimizer takes the same next
step as the one that never stopped (2 spawned ranks, TP=1 x DP=2)."""

import pytest
import torch

from megarl.parallel.spawn import run_on_ranks
from tests import checkpoint_worker


@pytest.fixture(scope="module")
def result(tiny_llama_dir, tmp_path_factory):
    return run_on_ranks(checkpoint_worker.run, 2, tiny_llama_dir, str(tmp_path_factory.mktemp("ckpt")))


def test_bug_a_a_fresh_distributed_optimizer_cannot_build_its_loading_template(result):
    assert result["bug_a"].startswith("AssertionError")


def test_bug_b_the_parameter_state_load_copies_step(result):
    assert result["bug_b"].startswith("KeyError") and "step" in result["bug_b"]


def test_bug_c_the_loaded_step_is_one_shared_tensor_and_the_next_step_is_wrong(result):
    assert result["bug_c_params"] > 1 and result["bug_c_distinct_steps"] == 1
    assert any(not torch.equal(result["bug_c"][k], result["straight"][k]) for k in result["straight"])


def test_with_the_workarounds_the_resumed_step_is_bitwise_the_uninterrupted_one(result):
    assert result["fused_after_load"] and all(result["fused_after_load"])  # torch's fused Adam on CPU, after the load
    assert result["lr"][0] == result["lr"][1]
    assert [k for k in result["straight"] if not torch.equal(result["resumed"][k], result["straight"][k])] == []


def test_a_save_creates_no_process_and_no_named_semaphore(result):
    """megarl/compat/checkpoint_writer.py: megatron's writer forks per file and creates named semaphores (a SIGKILL
    mid-``sem_open`` leaves ``/dev/shm/sem.XXXXXX``, which no sweep can attribute to the run); megarl's writes the
    same files from threads. The save it wrote is the one the bitwise resume above loads."""
    assert result["megatron_writer"]["semaphores"] > 0 and result["megatron_writer"]["forks"] > 0, result
    assert result["megarl_writer"] == {"semaphores": 0, "forks": 0}, result


@pytest.fixture(scope="module")
def expert_layouts(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("ckpt-ep")
    moe = make_tiny_hf_model(str(root / "moe"), "qwen3_moe")
    return run_on_ranks(checkpoint_worker.run_expert_layouts, 2, moe, str(root))


@pytest.mark.parametrize("direction", ["ep2_to_ep1", "ep1_to_ep2"])
def test_a_checkpoint_saved_at_one_ep_loads_at_another(expert_layouts, direction):
    """Experts saved by their global index (EP=2: four per rank) load at the other EP size bitwise, the distributed
    optimizer's Adam states resharded over the expert-data-parallel group: the next step equals the run that never
    stopped (the parity test's tolerance)."""
    r = expert_layouts[direction]
    assert r["loaded"].keys() == r["saved"].keys()
    assert [k for k in r["saved"] if not torch.equal(r["loaded"][k], r["saved"][k])] == []
    assert any(".local_experts.7." in k for k in r["saved"])  # every expert, named globally
    moved = max((r["straight"][k] - r["saved"][k]).abs().max().item() for k in r["saved"])
    assert moved > 1e-3
    worst = max((r["resumed"][k] - r["straight"][k]).abs().max().item() for k in r["straight"])
    assert worst <= 1e-5, worst
