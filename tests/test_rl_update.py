"""RL-update parity: the trainer's update (``learn``) on fixed rollout samples (sequences of 3 to 40 tokens) gives the
same metrics, old / reference log-probs, values and updated actor/critic weights at every layout and every micro-batch
split (packed by length, and in batch order) as on one rank with one sequence per micro-batch. This is the test that
proves the loss normalisation is global (over micro-batches and DP ranks) and the packing a pure reordering.

PPO: critic + GAE, KL loss to the reference, two mini-batches, seq-mean-token-mean. GRPO: token-mean with an entropy
bonus (vocab-parallel entropy under TP), one mini-batch. One spawned group per world size serves all cases.
"""

import pytest
import torch

from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.layout import ParallelLayout as L
from megarl.parallel.spawn import run_on_ranks
from tests.metric_tolerance import bf16_ulp, far_apart
from tests.rl_update_worker import FRONT_LOADED, LOPSIDED, lora_memory_overrides, memory_overrides, run_cases

RTOL = 1e-5
ATOL_WEIGHTS = 1e-5
FORWARD_RTOL = 1e-6
"""fp32 old / reference log-probs and values at another layout or packing, relative to the largest: the same forward,
summed in another order (log-probs near -7 differ by up to 5 fp32 steps of 4.8e-7 between micro-batch widths)."""
BF16_RTOL = 3e-2
"""bf16 against a single rank in bf16: another layout sums in another order and rounds its partial sums (a TP
all-reduce, a PP hand-over) to bf16's 8 significant bits, 2^-8 = 0.4% relative per rounding; through 2 layers and
the loss that compounds to a few roundings. 3e-2 (about 8 roundings' worth) is bf16's resolution with room, and
30x looser than nothing: a wrong normalisation (a factor of 2 across DP, a dropped micro-batch) is 50-100%."""
BF16_WEIGHT_ULPS = 2
"""Updated bf16 weights: the update (lr x gradient, fp32 main parameters) agrees within ``BF16_RTOL`` of its size,
and each weight is then rounded to bf16 once: a main parameter near a rounding boundary lands one bf16 step away, so
two steps (at the tensor's largest magnitude) plus ``BF16_RTOL`` of the largest update bound it."""
ALGOS = ("ppo", "grpo")
WORLD2 = [
    (f"ref_{a}_{s}", dict(layout=L(dp=2), algo=a, split=s, reference=True))
    for a in ALGOS
    for s in ("mbs1", "mbs2", "pack", "one")
]
WORLD2 += [
    (f"{n}_{a}", dict(layout=lay, algo=a, split="pack"))
    for n, lay in (("tp2", L(tp=2)), ("pp2", L(pp=2)), ("dp2", L(dp=2)))
    for a in ALGOS
]
ADAM = tuple(f"{m}.optim.{k}" for m in ("actor", "critic") for k in ("optimizer=adam", "adam_eps=1.0"))
"""Megatron's distributed optimizer takes Adam only: its first steps with eps >> |g| are smooth in the gradient
(lr g / (|g| + eps)), where eps = 1e-8 makes them lr sign(g), which fp32 noise flips on gradients near 0."""
DISTOPT = (*ADAM, "actor.optim.use_distributed_optimizer=true", "critic.optim.use_distributed_optimizer=true")
CONSECUTIVE = ("actor.packing=consecutive",)
WORLD2 += [(f"ref_{a}_adam", dict(layout=L(dp=2), algo=a, split="mbs1", reference=True, extra=ADAM)) for a in ALGOS]
WORLD2 += [(f"dp2_distopt_{a}", dict(layout=L(dp=2), algo=a, split="pack", extra=DISTOPT)) for a in ALGOS]
WORLD2 += [(f"dp2_consecutive_{a}", dict(layout=L(dp=2), algo=a, split="pack", extra=CONSECUTIVE)) for a in ALGOS]
WORLD2 += [("ref_lopsided_grpo", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True, shape=LOPSIDED)),
           ("dp2_lockstep_grpo", dict(layout=L(dp=2), algo="grpo", split="mbs2", lockstep=True, shape=LOPSIDED))]
WORLD2 += [("ref_front_grpo", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True, shape=FRONT_LOADED)),
           ("dp2_front_grpo", dict(layout=L(dp=2), algo="grpo", split="pack", shape=FRONT_LOADED)),
           ("dp2_front_consecutive_grpo", dict(layout=L(dp=2), algo="grpo", split="pack", shape=FRONT_LOADED,
                                               extra=CONSECUTIVE))]  # fmt: skip
WORLD2 += [
    (f"ref_gspo_tis_{s}", dict(layout=L(dp=2), algo="gspo_tis", split=s, reference=True)) for s in ("mbs2", "mbs1")
]
LORA_LAYOUTS = (("tp2", L(tp=2)), ("pp2", L(pp=2)), ("dp2", L(dp=2)))
WORLD2 += [("ref_lora", dict(layout=L(dp=2), algo="grpo_lora", split="mbs1", reference=True))]
WORLD2 += [(f"{n}_lora", dict(layout=lay, algo="grpo_lora", split="pack")) for n, lay in LORA_LAYOUTS]
RECOMPUTE = ("model.recompute=true",)
WORLD2 += [("pp2_recompute_lora", dict(layout=L(pp=2), algo="grpo_lora", split="pack", extra=RECOMPUTE))]
WORLD2 += [("mem_lora_tp2", dict(layout=L(tp=2), lora_memory=True)),
           ("mem_lora_tp2_bf16", dict(layout=L(tp=2), lora_memory=True, dtype="bfloat16"))]
GSPO_LAYOUTS = (("tp2", L(tp=2)), ("pp2", L(pp=2)))
WORLD2 += [(f"{n}_gspo_tis", dict(layout=lay, algo="gspo_tis", split="pack")) for n, lay in GSPO_LAYOUTS]
BF16 = ("model.dtype=bfloat16", "actor.global_batch_size=8")
"""bf16 cases train one mini-batch (the ratio is exactly 1: nothing is clipped). With two, a token whose ratio lies at
a clip boundary is clipped or not by bf16 noise, a discontinuity (of the loss's gradient, the grad norm, the clip
fractions) that no tolerance describes; the clipping itself is dtype-free (fp32 losses) and tested in fp32."""
WORLD2 += [(f"ref_{a}_mbs1_bf16", dict(layout=L(dp=2), algo=a, split="mbs1", reference=True, extra=BF16))
           for a in ALGOS]  # fmt: skip
WORLD2 += [(f"{n}_{a}_bf16", dict(layout=lay, algo=a, split="pack", extra=BF16))
           for n, lay in (("tp2", L(tp=2)), ("pp2", L(pp=2)), ("dp2", L(dp=2))) for a in ALGOS]  # fmt: skip
WORLD2 += [("ref_lora_bf16", dict(layout=L(dp=2), algo="grpo_lora", split="mbs1", reference=True, extra=BF16)),
           ("tp2_lora_bf16", dict(layout=L(tp=2), algo="grpo_lora", split="pack", extra=BF16))]  # fmt: skip
WORLD4 = [(f"ref_{a}_mbs1", dict(layout=L(dp=4), algo=a, split="mbs1", reference=True)) for a in ALGOS]
WORLD4 += [(f"tp2pp2_{a}", dict(layout=L(tp=2, pp=2), algo=a, split="mbs1")) for a in ALGOS]  # fmt: skip
WORLD4 += [(f"ref_{a}_mbs1_bf16", dict(layout=L(dp=4), algo=a, split="mbs1", reference=True, extra=BF16))
           for a in ALGOS]  # fmt: skip
WORLD4 += [(f"tp2pp2_{a}_bf16", dict(layout=L(tp=2, pp=2), algo=a, split="mbs1", extra=BF16)) for a in ALGOS]
# multi-turn episodes (observation tokens out of the loss; PPO with per-turn credit) at every layout, and in bf16
EPISODE = {"ppo": ("env.per_turn_credit=true",), "grpo": ()}
WORLD2 += [(f"ref_episodes_{a}", dict(layout=L(dp=2), algo=a, split="mbs1", reference=True, episodes=True,
                                      extra=EPISODE[a])) for a in ALGOS]  # fmt: skip
WORLD2 += [(f"{n}_episodes_{a}", dict(layout=lay, algo=a, split="pack", episodes=True, extra=EPISODE[a]))
           for n, lay, a in (("tp2", L(tp=2), "ppo"), ("pp2", L(pp=2), "grpo"), ("dp2", L(dp=2), "ppo"))]  # fmt: skip
WORLD2 += [(f"ref_episodes_grpo_{x}_altered", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True,
                                                   episodes=True, alter=x)) for x in ("obs", "model")]  # fmt: skip
WORLD2 += [("ref_episodes_grpo_bf16", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True, episodes=True,
                                           extra=BF16)),
           ("tp2_episodes_grpo_bf16", dict(layout=L(tp=2), algo="grpo", split="pack", episodes=True, extra=BF16))]
WORLD4 += [(f"tp2pp2_episodes_{a}", dict(layout=L(tp=2, pp=2), algo=a, split="mbs1", episodes=True,
                                         extra=EPISODE[a])) for a in ALGOS]  # fmt: skip
# Qwen3-MoE (both layers routed): GRPO with the load-balancing term at 0.01, one sequence per micro-batch, at DP=2
# and PP=2 (a routed layer per stage); LoRA on the attention at PP=2
MOE = ("actor.moe_aux_loss_coef=0.01",)
ATTENTION_LORA = ("actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",)
WORLD2 += [("ref_moe_grpo", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True, hf="moe", extra=MOE)),
           ("dp2_moe_grpo", dict(layout=L(dp=2), algo="grpo", split="mbs1", hf="moe", extra=MOE)),
           ("pp2_moe_grpo", dict(layout=L(pp=2), algo="grpo", split="mbs1", hf="moe", extra=MOE)),
           ("ref_moe_lora", dict(layout=L(dp=2), algo="grpo_lora", split="mbs1", reference=True, hf="moe",
                                 extra=(*MOE, *ATTENTION_LORA))),
           ("pp2_moe_lora", dict(layout=L(pp=2), algo="grpo_lora", split="pack", hf="moe",
                                 extra=(*MOE, *ATTENTION_LORA)))]  # fmt: skip
# expert parallelism: EP=2 (each rank 4 of the 8 experts), and a lopsided batch whose EP ranks run 1 and 7
# micro-batches (lockstep: 6 fillers on the first); EP=2 x PP=2 in WORLD4
WORLD2 += [("ep2_moe_grpo", dict(layout=L(dp=2, ep=2), algo="grpo", split="mbs1", hf="moe", extra=MOE)),
           ("ref_moe_lopsided", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True, hf="moe",
                                     shape=LOPSIDED, extra=MOE)),
           ("ep2_moe_lopsided", dict(layout=L(dp=2, ep=2), algo="grpo", split="mbs1", hf="moe", shape=LOPSIDED,
                                     extra=MOE))]  # fmt: skip
WORLD4 += [("ref_moe_grpo4", dict(layout=L(dp=4), algo="grpo", split="mbs1", reference=True, hf="moe", extra=MOE)),
           ("ep2pp2_moe_grpo", dict(layout=L(pp=2, dp=2, ep=2), algo="grpo", split="mbs1", hf="moe", extra=MOE))]
# rollout routing replay: the samples' (random) engine routes in every actor forward, at EP=2 and at PP=2 with
# activation recompute (1F1B: each recomputed forward replays its own micro-batch)
REPLAY = (*MOE, "actor.moe_routing_replay=rollout")
WORLD2 += [("ref_moe_replay", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True, hf="moe", extra=REPLAY,
                                   routes=True)),
           ("ep2_moe_replay", dict(layout=L(dp=2, ep=2), algo="grpo", split="mbs1", hf="moe", extra=REPLAY,
                                   routes=True)),
           ("pp2_moe_replay_recompute", dict(layout=L(pp=2), algo="grpo", split="mbs1", hf="moe", routes=True,
                                             extra=(*REPLAY, "model.recompute=true")))]  # fmt: skip
WORLD2 += [("ref_moe_grpo_bf16", dict(layout=L(dp=2), algo="grpo", split="mbs1", reference=True, hf="moe",
                                      extra=(*MOE, *BF16))),
           ("pp2_moe_grpo_bf16", dict(layout=L(pp=2), algo="grpo", split="mbs1", hf="moe", extra=(*MOE, *BF16)))]
# the planner against a real run (and the offload round trip) at (TP, PP, DP) = (2,1,1), (1,2,1), (2,1,2) distopt;
# Qwen3-MoE at DP=2, PP=2 and EP=2 (the experts in a buffer of their own, with the distributed optimizer)
MEMORY = {"mem_tp2": ("world2", L(tp=2), False, None), "mem_pp2": ("world2", L(pp=2), False, None),
          "mem_tp2dp2_distopt": ("world4", L(tp=2, dp=2), True, None),
          "mem_moe_dp2": ("world2", L(dp=2), False, "moe"),
          "mem_moe_pp2": ("world2", L(pp=2), False, "moe"),
          "mem_moe_ep2_distopt": ("world2", L(dp=2, ep=2), True, "moe")}  # fmt: skip
WORLD2 += [(n, dict(layout=lay, distopt=d, hf=hf)) for n, (w, lay, d, hf) in MEMORY.items() if w == "world2"]
WORLD4 += [(n, dict(layout=lay, distopt=d, hf=hf)) for n, (w, lay, d, hf) in MEMORY.items() if w == "world4"]


@pytest.fixture(scope="module")
def hf_dir(lora_llama_dir):
    return lora_llama_dir


@pytest.fixture(scope="module")
def adapter_dir(random_adapter_dir):
    return random_adapter_dir


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2, both layers routed) with larger weights, as ``hf_dir``."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("rl-moe") / "moe"), "qwen3_moe", seed=3, init_std=0.08)


@pytest.fixture(scope="module")
def world2(hf_dir, adapter_dir, moe_dir):
    lora = {"extra": (f"actor.lora.init_from={adapter_dir}",)}  # the Llama's adapter; the MoE's start fresh
    with_adapter = lambda kw: {**kw, "extra": (*kw.get("extra", ()), *lora["extra"])}  # noqa: E731
    cases = [(n, with_adapter(kw) if kw.get("algo") == "grpo_lora" and not kw.get("hf") else kw) for n, kw in WORLD2]
    cases = [(n, {**kw, "hf": moe_dir} if kw.get("hf") == "moe" else kw) for n, kw in cases]
    return run_on_ranks(run_cases, 2, hf_dir, cases)


@pytest.fixture(scope="module")
def world4(hf_dir, moe_dir):
    return run_on_ranks(run_cases, 4, hf_dir, [(n, {**kw, "hf": moe_dir} if kw.get("hf") == "moe" else kw)
                                               for n, kw in WORLD4])  # fmt: skip


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(b), 1e-3)


def _assert_same_update(case: dict, ref: dict, bf16: bool = False):
    """Equal metrics (token fractions within one token), advantages and updated weights: within fp32 noise, or in
    bf16 within bf16's resolution (``BF16_RTOL``, ``BF16_WEIGHT_ULPS``)."""
    rtol = BF16_RTOL if bf16 else RTOL
    for group in ("actor", "critic"):
        assert case[group].keys() == ref[group].keys()
        far = far_apart(case[group], ref[group], set(ref[group]) - {"lr"}, rtol=rtol, floor=1e-3,
                        token_share=ref["token_share"])  # fmt: skip
        assert not far, (group, far)
    assert (case["advantages"] - ref["advantages"]).abs().max() <= (BF16_RTOL if bf16 else 1e-5)
    assert case["forward"].keys() == ref["forward"].keys()
    for name, ref_values in ref["forward"].items():  # old / reference log-probs, values: before any update
        diff = (case["forward"][name] - ref_values).abs().max().item()
        assert diff <= (BF16_RTOL if bf16 else FORWARD_RTOL) * ref_values.abs().max().item(), (name, diff)
    for key in ("weights", "critic_weights", "adapters"):
        if key not in ref:
            continue
        for name, w_ref in ref[key].items():
            diff = (case[key][name].float() - w_ref.float()).abs().max().item()
            tol = ATOL_WEIGHTS
            if not bf16 and key == "weights" and "initial" in ref:  # fp32 noise grows with the update's size
                tol += RTOL * (w_ref - ref["initial"][name]).abs().max().item()
            if bf16 and key == "adapters":  # fp32 LoRA factors trained on bf16 activations
                tol = BF16_RTOL * w_ref.abs().max().item()
            elif bf16:
                # the actor from its initial weights (LoRA: none, its base is frozen), the critic from zero
                start = ref.get("initial", ref[key])[name] if key == "weights" else torch.zeros_like(w_ref)
                update = (w_ref.float() - start.float()).abs().max().item()
                tol = BF16_WEIGHT_ULPS * bf16_ulp(w_ref) + BF16_RTOL * update
            assert diff <= tol, f"{key} {name}: max |w - w_ref| = {diff} > {tol}"


def test_the_update_really_moves_the_weights(world2):
    ref = world2["ref_ppo_mbs1"]
    moved = max((ref["weights"][n] - ref["initial"][n]).abs().max().item() for n in ref["weights"])
    assert moved > 100 * ATOL_WEIGHTS
    assert ref["actor"]["actor/kl_loss"] > 0 and ref["critic"]["critic/vf_loss"] > 0
    assert world2["ref_grpo_mbs1"]["actor"]["actor/entropy"] > 1.0


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("split", ["mbs2", "pack", "one"])
def test_micro_batch_split_does_not_change_the_update(world2, algo, split):
    _assert_same_update(world2[f"ref_{algo}_{split}"], world2[f"ref_{algo}_mbs1"])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_layout_matches_single_rank_world2(world2, algo, layout):
    _assert_same_update(world2[f"{layout}_{algo}"], world2[f"ref_{algo}_mbs1"])


@pytest.mark.parametrize("case", ["tp2_episodes_ppo", "pp2_episodes_grpo", "dp2_episodes_ppo"])
def test_multi_turn_episodes_update_at_every_layout_as_on_one_rank(world2, case):
    _assert_same_update(world2[case], world2[f"ref_episodes_{case.rsplit('_', 1)[1]}"])


@pytest.mark.parametrize("algo", ALGOS)
def test_multi_turn_episodes_at_tp2pp2_update_as_on_one_rank(world2, world4, algo):
    """Against world 2's single-rank reference: the same batch on one rank whatever the world."""
    _assert_same_update(world4[f"tp2pp2_episodes_{algo}"], world2[f"ref_episodes_{algo}"])


def test_multi_turn_episodes_in_bf16_update_as_on_one_rank(world2):
    _assert_same_update(world2["tp2_episodes_grpo_bf16"], world2["ref_episodes_grpo_bf16"], bf16=True)


def test_observation_tokens_get_no_gradient_and_model_tokens_do(world2):
    """Changing the tokens of an episode's trailing observation (targets whose loss the mask leaves out) leaves the
    update bitwise the same; changing a model token changes it."""
    ref = world2["ref_episodes_grpo"]
    for key in ("weights", "actor"):
        same, other = world2["ref_episodes_grpo_obs_altered"][key], world2["ref_episodes_grpo_model_altered"][key]
        if key == "actor":
            assert same == ref[key]
            assert other != ref[key]
            continue
        assert all(torch.equal(same[n], w) for n, w in ref[key].items())
        assert max((other[n] - w).abs().max().item() for n, w in ref[key].items()) > 1e-6


def test_episode_advantages_cover_model_tokens_only(world2):
    """One advantage (and old / reference log-prob, value) per model token: observation tokens have none."""
    from tests.rl_update_worker import SPREAD, episode_mask

    model_tokens = sum(sum(episode_mask(n)) for _, lens in SPREAD for n in lens)
    for algo in ALGOS:
        assert world2[f"ref_episodes_{algo}"]["advantages"].numel() == model_tokens
        forward = world2[f"ref_episodes_{algo}"]["forward"]  # GRPO (one mini-batch): no separate forward
        assert all(v.numel() == model_tokens for v in forward.values()) and (forward or algo == "grpo"), forward.keys()


@pytest.mark.parametrize("algo", ALGOS)
def test_dp2_with_the_distributed_optimizer_matches_single_rank(world2, algo):
    _assert_same_update(world2[f"dp2_distopt_{algo}"], world2[f"ref_{algo}_adam"])


@pytest.mark.parametrize("algo", ALGOS)
def test_dp2_in_batch_order_matches_single_rank(world2, algo):
    _assert_same_update(world2[f"dp2_consecutive_{algo}"], world2[f"ref_{algo}_mbs1"])


def _tokens_per_rank(case: dict) -> list[list[int]]:
    """Per pass (old log-probs, the update...), each DP rank's positions."""
    per_rank = case["passes_per_rank"]
    return [[sum(map(sum, rank[k])) for rank in per_rank] for k in range(len(per_rank[0]))]


def test_dp_ranks_get_token_balanced_shares_in_a_real_step(world2):
    """Every long sequence in the batch's first half: contiguous shares give rank 0 nearly every token; the default
    shares keep the two ranks within the longest sequence of each other, and the update is the single rank's."""
    longest = max(p + r for p, responses in FRONT_LOADED for r in responses) - 1
    balanced, contiguous = world2["dp2_front_grpo"], world2["dp2_front_consecutive_grpo"]
    for tokens in _tokens_per_rank(balanced):
        assert abs(tokens[0] - tokens[1]) <= longest, tokens
    assert all(abs(t[0] - t[1]) > 2 * longest for t in _tokens_per_rank(contiguous))
    for case in (balanced, contiguous):
        _assert_same_update(case, world2["ref_front_grpo"])


def test_ranks_in_lockstep_run_as_many_micro_batches_and_the_fillers_weigh_nothing(world2):
    """What an expert-parallel group needs (``plan``'s ``lockstep``): the rank with fewer micro-batches runs fillers
    up to the other's count, and the update is still the single rank's."""
    case = world2["dp2_lockstep_grpo"]
    (update_0,), (update_1,) = case["passes_per_rank"]  # GRPO's one mini-batch: the update's pass only
    assert [len(update_0), len(update_1)] == [4, 4]  # 1 sequence and 7 in micro-batches of 2: 1 + 3 fillers, 4
    assert update_0[1:] == [[], [], []] and [] not in update_1
    _assert_same_update(case, world2["ref_lopsided_grpo"])


@pytest.mark.parametrize("case", ["dp2_ppo", "dp2_consecutive_ppo", "ref_ppo_mbs1", "pp2_ppo", "dp2_lockstep_grpo"])
def test_the_step_counts_the_micro_batches_it_ran(world2, case):
    """``Learned.packed`` (perf/padding_frac, perf/micro_batches) is what the ranks ran: its positions, padded
    positions and micro-batches equal those of every pass's micro-batches on every DP rank (one PP stage each)."""
    got = world2[case]
    per_rank = got["passes_per_rank"][:1] if case == "pp2_ppo" else got["passes_per_rank"]
    if case.startswith("ref_"):  # every DP replica ran the whole batch: one of them is the single-rank run
        per_rank = per_rank[:1]
    groups = [g for rank in per_rank for passes in rank for g in passes]
    assert got["packed"].micro_batches == len(groups) > 0
    assert got["packed"].real == sum(map(sum, groups))
    assert got["packed"].computed == sum(max(len(g), 1) * max(g, default=1) for g in groups)  # a filler: 1 position
    if case in ("ref_ppo_mbs1", "dp2_consecutive_ppo"):  # one sequence per micro-batch: none; neighbours: some
        assert (got["packed"].padding_frac == 0) == (case == "ref_ppo_mbs1")


@pytest.mark.parametrize("algo", ALGOS)
def test_tp2pp2_matches_single_rank(world4, algo):
    _assert_same_update(world4[f"tp2pp2_{algo}"], world4[f"ref_{algo}_mbs1"])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_bf16_layout_matches_single_rank_bf16(world2, algo, layout):
    _assert_same_update(world2[f"{layout}_{algo}_bf16"], world2[f"ref_{algo}_mbs1_bf16"], bf16=True)


@pytest.mark.parametrize("algo", ALGOS)
def test_bf16_tp2pp2_matches_single_rank_bf16(world4, algo):
    _assert_same_update(world4[f"tp2pp2_{algo}_bf16"], world4[f"ref_{algo}_mbs1_bf16"], bf16=True)


@pytest.mark.parametrize("algo", ALGOS)
def test_bf16_updates_bf16_weights_and_computes_what_fp32_computes(world2, algo):
    """The bf16 update keeps every weight bf16 and moves every one of them; GRPO (one mini-batch in both dtypes)
    computes the fp32 run's losses within bf16's resolution (its initial weights are the fp32 ones rounded)."""
    bf16, fp32 = world2[f"ref_{algo}_mbs1_bf16"], world2[f"ref_{algo}_mbs1"]
    assert {w.dtype for w in [*bf16["weights"].values(), *bf16["initial"].values()]} == {torch.bfloat16}
    still = [n for n, w in bf16["weights"].items() if torch.equal(w, bf16["initial"][n])]
    assert still == [] and bf16["critic"].keys() == fp32["critic"].keys()
    if algo == "grpo":
        for k in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl"):
            assert abs(bf16["actor"][k] - fp32["actor"][k]) <= BF16_RTOL * max(abs(fp32["actor"][k]), 1e-2), k


def test_bf16_lora_update_matches_single_rank_with_fp32_adapters_and_a_bitwise_base(world2):
    ref, case = world2["ref_lora_bf16"], world2["tp2_lora_bf16"]
    assert {a.dtype for a in ref["adapters"].values()} == {torch.float32}  # LoRA adapters train in fp32
    _assert_same_update(case, ref, bf16=True)
    assert case["base_bitwise"] and ref["base_bitwise"]


def test_lora_update_matches_single_rank_and_leaves_the_base_bitwise(world2, adapter_dir):
    """From a non-zero adapter (so A's gradient matters): the same losses and updated adapters at TP=2, PP=2, DP=2
    as on one rank; only the adapters train, and they move."""
    from safetensors.torch import load_file

    ref = world2["ref_lora"]
    start = load_file(f"{adapter_dir}/adapter_model.safetensors")
    assert ref["adapters"].keys() == start.keys() and len(start) == 2 * 7 * 2  # 2 layers x 7 targets x (A, B)
    assert max((ref["adapters"][k] - start[k]).abs().max().item() for k in start) > 100 * ATOL_WEIGHTS
    assert ref["actor"]["actor/kl_loss"] > 0  # the reference (adapters off) differs from the adapted actor
    for name in [n for n, _ in LORA_LAYOUTS] + ["pp2_recompute"]:  # recompute: the first stage's adapters train too
        case = world2[f"{name}_lora"]
        _assert_same_update(case, ref)
        assert case["base_bitwise"], name
    assert ref["base_bitwise"] and ref["trainable"] == sum(v.numel() for v in start.values())


@pytest.mark.parametrize("case", ["dp2_moe_grpo", "pp2_moe_grpo"])
def test_moe_update_with_load_balancing_matches_single_rank(world2, case):
    """Qwen3-MoE with the load-balancing term at 0.01: the same update (metrics, moe/aux_loss, router and experts'
    weights) at DP=2 and PP=2 as on one rank; the router moves."""
    ref = world2["ref_moe_grpo"]
    assert ref["actor"]["moe/aux_loss"] > 0.5  # about 1 for a near-uniform router (switch loss)
    router = "decoder.layers.0.mlp.router.weight"
    assert (ref["weights"][router] - ref["initial"][router]).abs().max() > 100 * ATOL_WEIGHTS
    _assert_same_update(world2[case], ref)


def test_moe_update_at_ep2_and_ep2_pp2_matches_single_rank(world2, world4):
    """Experts split over two DP ranks (alone and with a routed layer per stage): the one-rank update."""
    _assert_same_update(world2["ep2_moe_grpo"], world2["ref_moe_grpo"])
    _assert_same_update(world4["ep2pp2_moe_grpo"], world4["ref_moe_grpo4"])


def test_ep_ranks_with_1_and_7_micro_batches_run_in_lockstep_and_match_single_rank(world2):
    """A real expert-parallel group (no stand-in for ``_lockstep``): the rank holding one sequence runs six fillers
    beside the other's seven micro-batches, every all-to-all is met, and neither the loss nor the load-balancing term
    nor ``moe/aux_loss`` sees the fillers."""
    case = world2["ep2_moe_lopsided"]
    (update_0,), (update_1,) = case["passes_per_rank"]
    assert [len(update_0), len(update_1)] == [7, 7] and update_0[1:] == [[]] * 6 and [] not in update_1
    _assert_same_update(case, world2["ref_moe_lopsided"])


@pytest.mark.parametrize("case", ["ep2_moe_replay", "pp2_moe_replay_recompute"])
def test_moe_update_replaying_the_engine_routes_matches_single_rank(world2, case):
    """``actor.moe_routing_replay=rollout`` with engine routes that are not the routers' own (random experts): every
    real (position, layer) pair is routed to them (old log-probs and update), the update differs from one routing
    itself, and it equals one rank's at EP=2 and at PP=2 with activation recompute."""
    ref = world2["ref_moe_replay"]
    assert ref["actor"]["moe/routing_replayed"] == 1.0 and ref["actor"]["moe/routing_agreement"] < 0.2, ref["actor"]
    router = "decoder.layers.0.mlp.router.weight"
    own = world2["ref_moe_grpo"]["weights"][router] - ref["initial"][router]
    assert (ref["weights"][router] - ref["initial"][router] - own).abs().max() > 0.1 * own.abs().max()
    _assert_same_update(world2[case], ref)
    assert world2[case]["actor"]["moe/routing_replayed"] == 1.0


def test_moe_update_in_bf16_matches_single_rank_bf16(world2):
    _assert_same_update(world2["pp2_moe_grpo_bf16"], world2["ref_moe_grpo_bf16"], bf16=True)


def test_moe_lora_on_the_attention_matches_single_rank(world2):
    """LoRA on q/k/v/o of a Qwen3-MoE at PP=2 (a routed layer per stage) as on one rank; the base stays bitwise."""
    ref, case = world2["ref_moe_lora"], world2["pp2_moe_lora"]
    assert len(ref["adapters"]) == 2 * 4 * 2 and max(a.abs().max().item() for a in ref["adapters"].values()) > 0
    _assert_same_update(case, ref)
    assert case["base_bitwise"] and ref["base_bitwise"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_bytes_equal_what_a_lora_run_allocates(world2, hf_dir, dtype):
    """LoRA (Adam, distributed optimizer, TP=2): the frozen base plus the adapters (fp32 in both dtypes), gradient
    buffers and optimizer state on the adapters only, no reference copy; the planner's bytes are the allocated ones,
    exactly."""
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.planner.memory import rank_memory

    cfg = load_config(None, lora_memory_overrides(hf_dir, L(tp=2), dtype))
    planned = rank_memory(cfg, spec_from_hf_config(read_hf_config(hf_dir)), L(tp=2), gpus_per_node=2)
    case = "mem_lora_tp2" + ("_bf16" if dtype == "bfloat16" else "")
    for rank, real in enumerate(world2[case]["per_rank"]):
        plan = planned[rank].consumers
        assert {k: plan[k] for k in real["measured"]} == real["measured"], f"rank {rank}"
        assert not real["reference"] and "reference params" not in plan
        assert 0 < real["measured"]["actor grads"] < real["measured"]["actor params"] / 10


def test_lora_logprobs_equal_hf_with_peft(world2, hf_dir, adapter_dir):
    """The TP=2 LoRA actor's log-probs (before its update) equal HF + peft's on the same weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    got = world2["tp2_lora"]["logits"]
    base_hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        base = torch.log_softmax(base_hf(got["tokens"]).logits.float(), -1)
        adapted = torch.log_softmax(PeftModel.from_pretrained(base_hf, adapter_dir)(got["tokens"]).logits.float(), -1)
    assert (torch.log_softmax(got["adapted"], -1) - adapted).abs().max() <= 1e-5
    assert (torch.log_softmax(got["base"], -1) - base).abs().max() <= 1e-5  # adapters off = the base model
    assert (adapted - base).abs().max() > 1e-2  # the adapter's effect is visible


def test_updated_adapters_export_to_a_directory_peft_loads(world2, hf_dir):
    """gather_adapters + write_peft_adapter after the TP=2 update: peft loads it onto the HF base and gives the
    updated actor's logits."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    case = world2["tp2_lora"]
    try:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                          case["exported"])  # fmt: skip
        got = case["after_update"]
        with torch.no_grad():
            assert (model(got["tokens"]).logits.float() - got["adapted"]).abs().max() <= 1e-5
    finally:
        shutil.rmtree(case["exported"])


def test_gspo_with_truncated_importance_sampling_matches_single_rank(world2):
    """GSPO's sequence ratio and TIS's per-token weights under micro-batch splits, TP and PP."""
    ref = world2["ref_gspo_tis_mbs1"]
    assert ref["actor"]["rollout/is_masked_frac"] > 0 and ref["actor"]["actor/pg_clipfrac"] > 0  # both bite
    for case in ("ref_gspo_tis_mbs2", "tp2_gspo_tis", "pp2_gspo_tis"):
        _assert_same_update(world2[case], ref)


def test_megatron_016_tp_attribute_bug_is_worked_around(world2):
    """Without megarl.compat.megatron_fixes, no TP-split weight of a model built for loading carries
    ``tensor_model_parallel`` (so TP rank 1's shards were left out of the gradient norm); the builder restores all."""
    bug = world2["tp_attribute_bug"]
    assert not any(bug["before"].values()) and bug["restored"] == len(bug["before"])
    assert all(bug["after"].values()) and all(bug["builder"].values())


def _memory_case(request, hf_dir, name):
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.planner.memory import rank_memory

    world, layout, distopt, hf = MEMORY[name]
    hf_dir = request.getfixturevalue("moe_dir") if hf == "moe" else hf_dir
    cfg = load_config(None, memory_overrides(hf_dir, layout, distopt))
    planned = rank_memory(cfg, spec_from_hf_config(read_hf_config(hf_dir)), layout, gpus_per_node=layout.world_size)
    return request.getfixturevalue(world)[name], planned


@pytest.mark.parametrize("name", list(MEMORY))
def test_planner_bytes_equal_what_a_real_run_allocates(request, hf_dir, name):
    """Parameters, gradient buffers and optimizer state of actor, critic and reference, per rank, after one real
    update: the planner's numbers are the allocated bytes, exactly (DDP padding and distopt shards included)."""
    case, planned = _memory_case(request, hf_dir, name)
    for rank, real in enumerate(case["per_rank"]):
        plan = planned[rank].consumers
        assert {k: plan[k] for k in real["measured"]} == real["measured"], f"rank {rank}"


@pytest.mark.parametrize("name", list(MEMORY))
def test_offload_round_trip_is_bitwise_and_frees_what_the_planner_says(request, hf_dir, name):
    case, planned = _memory_case(request, hf_dir, name)
    for rank, real in enumerate(case["per_rank"]):
        assert real["freed"] == planned[rank].offloaded, f"rank {rank}"
        assert sum(real["pinned"]) == sum(planned[rank].offloaded.values()), f"rank {rank}"  # exact pinned sizes
        assert set(real["freed"]) == {"actor grads", "actor optimizer", "critic params+grads+optimizer",
                                      "reference params"}  # fmt: skip
    assert case["emptied"] and case["actor_params_stay"]
    assert case["bitwise"]
    assert case["after_round_trip"] == case["never_offloaded"]  # the next update: equal losses, exactly


@pytest.mark.parametrize("name", ["mem_tp2"])
def test_recompute_gives_the_same_update(request, hf_dir, name):
    case, _ = _memory_case(request, hf_dir, name)
    for group in ("actor", "critic"):
        for k, v in case["never_offloaded"][group].items():
            assert _close(case["recomputed"][group][k], v), (group, k)


def test_per_pool_planner_bytes_equal_what_each_pools_layout_allocates(request, hf_dir):
    """Pools: the actor at TP=2 on ranks 0-1, the critic and the reference at PP=2 on ranks 2-3 (critic.parallel),
    the engines on 4-5. Each pool's ranks hold only their roles' state, at their pool's layout: exactly the bytes the
    real TP=2 and PP=2 runs allocated for those roles; nothing is offloaded."""
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.planner.memory import rank_memory

    pools = ["placement.pools.train.ranks=0-1", "placement.pools.train.roles=[actor]",
             "placement.pools.critic.ranks=2-3", "placement.pools.critic.roles=[critic,reference]",
             "placement.pools.rollout.ranks=4-5", "placement.pools.rollout.roles=[rollout]",
             "critic.parallel.pp=2", "offload.enable=auto"]  # fmt: skip
    cfg = load_config(None, memory_overrides(hf_dir, L(tp=2), False) + pools)
    planned = rank_memory(cfg, spec_from_hf_config(read_hf_config(hf_dir)), L(tp=2), gpus_per_node=6)
    actor_run, critic_run = _memory_case(request, hf_dir, "mem_tp2")[0], _memory_case(request, hf_dir, "mem_pp2")[0]
    roles = {"train": ("actor params", "actor grads", "actor optimizer"),
             "critic": ("critic params+grads+optimizer", "reference params")}  # fmt: skip
    for m in planned:
        assert m.offloaded == {} and m.pool == ("train", "train", "critic", "critic", "rollout", "rollout")[m.rank]
        held = roles.get(m.pool, ())
        if held:
            run = actor_run if m.pool == "train" else critic_run
            real = run["per_rank"][m.rank % 2]["measured"]
            assert {k: m.consumers[k] for k in held} == {k: real[k] for k in held}, m.rank
        others = [k for ks in roles.values() for k in ks if k not in held]
        assert all(m.consumers[k] == 0 for k in others), (m.rank, m.consumers)
        assert (m.consumers["vLLM weights"] > 0) == (m.pool == "rollout")
