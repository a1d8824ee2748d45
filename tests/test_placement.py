"""Placement and dtype, guarded on a CPU machine: with ``MEGARL_FAKE_DEVICE=meta`` the CPU shim makes "the GPU" the
meta device, so a tensor that a model, head, adapter or optimizer left on the CPU (never moved to the rank's device)
is visible as such. Every role of an RL job is built at TP=2 x PP=2 as the trainer builds it, in bf16 and fp32."""

import pytest

from megarl.compat.cpu import FAKE_DEVICE_VAR
from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.spawn import run_on_ranks
from tests.placement_worker import run_placement

DTYPES = ["bfloat16", "float32"]


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement")
    hf = make_tiny_hf_model(str(tmp / "llama"), "llama")
    rm = make_tiny_hf_model(str(tmp / "rm"), "llama", seed=7, num_labels=1)
    with pytest.MonkeyPatch.context() as mp:  # the ranks inherit it: their shim's device is meta
        mp.setenv(FAKE_DEVICE_VAR, "meta")
        return run_on_ranks(run_placement, 4, hf, rm, DTYPES)


@pytest.fixture(params=DTYPES)
def built(request, placed):
    return request.param, placed[request.param]


def test_every_role_is_built_with_every_tensor_on_the_rank_device(built):
    dtype, cases = built
    assert set(cases["ppo"][0]) == {"actor", "critic", "reference", "reward_model"}
    assert set(cases["lora"][0]) == {"actor", "critic", "reward_model"}  # LoRA: no reference copy
    on_cpu = {(case, rank, role, name)
              for case, ranks in cases.items() for rank, roles in enumerate(ranks)
              for role, held in roles.items() for name, (device, _) in held.items() if device != "meta"}  # fmt: skip
    assert on_cpu == set(), sorted(on_cpu)[:20]
    rope = [n for n in cases["ppo"][0]["actor"] if n.endswith("inv_freq")]
    assert rope and all(cases["ppo"][0]["actor"][n][1] == "float32" for n in rope)  # Megatron keeps RoPE in fp32


def test_every_parameter_has_the_models_dtype_and_the_optimizer_fp32_main_parameters(built):
    """Megatron's Float16Module rule: every parameter (norms, value and score heads included) in model.dtype;
    LoRA adapters in fp32 whatever the model dtype; the optimizer's main parameters fp32."""
    dtype, cases = built
    wrong = set()
    for case, ranks in cases.items():
        for rank, roles in enumerate(ranks):
            for role, held in roles.items():
                for name, (_, got) in held.items():
                    want = ("float32" if ".lora." in name or name.startswith(("main param", "grad buffer"))
                            else dtype if name.startswith("param") else None)  # fmt: skip
                    if want is not None and got != want:
                        wrong.add((case, rank, role, name, got))
    assert wrong == set(), sorted(wrong)[:20]
    actor = cases["lora"][0]["actor"]
    assert any(".lora." in n for n in actor) and any(n.startswith("main param") for n in actor)
    heads = [n for n in cases["ppo"][3]["critic"] if "output_layer" in n and n.startswith("param")]
    assert heads and all(cases["ppo"][3]["critic"][n][1] == dtype for n in heads)
    norms = [n for n in cases["ppo"][0]["actor"] if "layernorm" in n and n.startswith("param")]
    assert norms and all(cases["ppo"][0]["actor"][n][1] == dtype for n in norms)
