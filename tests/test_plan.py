"""The memory planner without a GPU: exact parameter counts for Llama-2-70B at TP4/PP8/DP2, Megatron's buffer
padding rules on hand-computed cases, refusals, and `megarl plan` / `megarl train --dry-run` on the shipped 70B
recipe. (The planner against the bytes a real run allocates: tests/test_rl_update.py.)"""

import math

import pytest

from megarl.cli import main
from megarl.config import load_config, validate
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.megatron_shards import REPLICATED, tp_split
from megarl.planner.job import Hardware, PlanError, apply, format_plan, make_plan
from megarl.planner.memory import Param, grad_buffer, model_params
from megarl.reshard.layout import megatron_layout

RECIPE = "configs/llama2_70b_ppo_tp4pp8dp2.yaml"
LLAMA2_70B_PARAMS = 68_976_648_192  # embed + lm_head 2 x 32000 x 8192, 80 layers x 855,654,400, final norm 8192


@pytest.fixture(scope="module")
def seeds_job():
    cfg = load_config(RECIPE, [])
    return cfg, validate(cfg)


def test_llama2_70b_parameter_counts_per_rank_and_total(seeds_job):
    cfg, spec = seeds_job
    assert spec.padded_vocab_size == spec.vocab_size == 32000
    layout = ParallelLayout(tp=4, pp=8, dp=2, gpus_per_node=8)
    actor = model_params(spec, layout)
    side = megatron_layout(spec, layout, 8)
    for rank in range(64):  # the planner's counts are the layout description's
        assert sum(p.numel for p in actor[rank]) == sum(math.prod(s.shape) for s in side.ranks[rank])
    replica = [layout.rank(tp, pp, 0) for pp in range(8) for tp in range(4)]
    # a replica holds the model once, except that every TP rank holds the (replicated) norm weights
    once = lambda r, p: tp_split(p.name) != REPLICATED or layout.coords(r).tp == 0  # noqa: E731
    assert sum(p.numel for r in replica for p in actor[r] if once(r, p)) == LLAMA2_70B_PARAMS
    middle = sum(p.numel for p in actor[layout.rank(0, 3, 0)])  # 10 layers, a quarter of each matrix
    assert middle == 10 * (855_654_400 - 2 * 8192) // 4 + 10 * 2 * 8192
    critic = model_params(spec, layout, value_head=True)
    last = layout.rank(0, 7, 0)
    assert sum(p.numel for p in critic[last]) == sum(p.numel for p in actor[last]) - 8000 * 8192 + 8192 + 1


def test_grad_buffer_follows_megatrons_padding_rules():
    params = [Param("a", 100), Param("b", 1)]  # module order; the buffer is filled in reverse
    plain = grad_buffer(params, dp=2, distributed_optimizer=False)
    assert plain.numel == 101 and plain.ranges == {"b": (0, 1), "a": (1, 101)}
    dist = grad_buffer(params, dp=2, distributed_optimizer=True)
    assert dist.ranges == {"b": (0, 1), "a": (64, 164)}  # each parameter starts at a multiple of 64
    assert dist.buckets == [(0, 256)] and dist.numel == 256  # padded to lcm(dp, 128)
    assert (dist.shard_numel(0, 2), dist.shard_numel(1, 2)) == (1 + 64, 36)
    tied = [Param("embedding.word_embeddings.weight", 200, True), Param("x", 10)]  # own bucket with distopt
    buf = grad_buffer(tied, dp=3, distributed_optimizer=True)
    assert buf.buckets == [(0, 384), (384, 768)] and buf.ranges["embedding.word_embeddings.weight"] == (384, 584)


def test_seeds_job_fits_with_offload_and_says_why(seeds_job, capsys):
    assert main(["plan", RECIPE]) == 0
    out = capsys.readouterr().out
    assert "node 7: ranks 56-63  tp 0-3  pp 7  dp 0-1" in out
    assert "FITS: peak" in out and "training" in out
    assert "actor optimizer [offloaded]" in out and "estimated sync time" in out
    cfg, spec = seeds_job
    job = make_plan(cfg, spec, Hardware(8, 8), sync=False)
    m, phase, peak = job.worst()
    assert job.fits and peak < 80e9
    gen = m.phase_bytes("generation")
    assert gen == sum(m.consumers[c] for c in m.consumers if c not in m.offloaded and c in m.phases["generation"])


def test_without_megarls_memory_settings_it_does_not_fit_and_the_plan_says_what_would(seeds_job):
    off = ["offload.enable=false", "actor.optim.use_distributed_optimizer=false",
           "critic.optim.use_distributed_optimizer=false", "model.recompute=false"]  # fmt: skip
    cfg, spec = seeds_job
    job = make_plan(apply(cfg, off), spec, Hardware(8, 8), sync=False)  # the sync plan: the test above
    assert not job.fits
    out = format_plan(job)
    assert "DOES NOT FIT: rank 0 needs 135.4 GB during training" in out
    assert "largest: activations (saved for backward) 49.5" in out
    assert "still over with distributed optimizer" in out  # alone: the generation phase still holds everything
    assert "would fit with distributed optimizer + offload during generation + activation recompute" in out


def test_a_tp_group_across_nodes_and_a_wrong_world_are_refused(seeds_job, capsys):
    cfg, spec = seeds_job
    with pytest.raises(PlanError, match=r"the TP group of ranks \[0, 1, 2, 3\] would span nodes \[0, 1\]"):
        make_plan(cfg, spec, Hardware(nodes=32, gpus_per_node=2))
    with pytest.raises(PlanError, match="--nodes 4 x --gpus-per-node 8 = 32 ranks"):
        make_plan(cfg, spec, Hardware(nodes=4, gpus_per_node=8))
    assert main(["plan", RECIPE, "--nodes", "32", "--gpus-per-node", "2"]) == 2
    assert "use a tp that divides --gpus-per-node ([1, 2])" in capsys.readouterr().err


def test_train_dry_run_prints_the_same_verdict(tiny_llama_dir, capsys):
    assert main(["train", "configs/tiny_ppo.yaml", f"model.path={tiny_llama_dir}", "--dry-run"]) == 0
    assert "memory plan: fits on 1x2 GPUs of 80 GB" in capsys.readouterr().out


def test_a_lora_plan_syncs_the_base_once_then_only_the_adapters():
    """Adapter slots: every later sync moves every full factor to each of the 64 ranks (vLLM's LoRA loader slices
    them itself), except what a rank holds itself; merged (the default when colocated) the whole weights every time."""
    from megarl.planner.memory import lora_sync_bytes
    from megarl.reshard.layout import megatron_adapter_layout

    overrides = ["model.transformer_impl=local", "actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"]
    cfg = load_config(RECIPE, [*overrides, "rollout.lora_merge=false"])
    spec = validate(cfg)
    job = make_plan(cfg, spec, Hardware(8, 8))
    held = megatron_adapter_layout(spec, cfg.actor.lora, job.layout, 8)
    local = 2 * sum(b.numel for shards in held.ranks.values() for s in shards for b in s.blocks)  # bf16
    adapters = job.sync["adapters"]
    assert adapters["written"] == lora_sync_bytes(spec, cfg.actor.lora, "bfloat16")  # into each engine rank
    assert adapters["moved"] == 64 * adapters["written"] - local
    assert job.sync["moved"] > 100 * adapters["moved"] and job.sync["est_s"] > 10 * adapters["est_s"]
    text = format_plan(job)
    assert "every later sync (the LoRA adapters into vLLM's LoRA slots" in text
    from megarl.planner.job import host_memory_per_node

    asleep = sum(m.consumers["vLLM weights"] for m in job.ranks[:8])  # node 0's engines sleep at level 1
    assert host_memory_per_node(job)[0]["vLLM weights while asleep"] == asleep > 0
    assert "host memory (pinned) per node: up to " in text and "vLLM weights while asleep" in text
    merged = load_config(RECIPE, overrides)  # lora_merge: auto merges (a colocated engine)
    assert "adapters" not in make_plan(merged, validate(merged), Hardware(8, 8)).sync


def test_a_rollout_pool_is_planned_on_its_own_ranks():
    """The 70B recipe with 4 nodes of engines beside its 8 training nodes: the engines' ranks hold only vLLM's
    weights and KV cache, the actor's only training state (nothing offloaded: no engine shares their devices), and
    the cross-pool sync moves exactly the lower bounds: ``rank_min`` in all, ``node_min`` across nodes (each byte
    crosses into a rollout node once; what several of its ranks need is forwarded inside it)."""
    from megarl.reshard.layout import vllm_layout
    from megarl.reshard.plan import theoretical_minimum

    pools = ["placement.pools.train.ranks=0-63", "placement.pools.train.roles=[actor,critic,reference]",
             "placement.pools.rollout.ranks=64-95", "placement.pools.rollout.roles=[rollout]",
             "offload.enable=auto"]  # fmt: skip
    cfg = load_config(RECIPE, pools)
    job = make_plan(cfg, validate(cfg), Hardware(12, 8))
    assert [m.rank for m in job.ranks] == list(range(96))
    for m in job.ranks:
        training = sum(v for k, v in m.consumers.items() if k.startswith(("actor", "critic", "reference")))
        engine = m.consumers["vLLM weights"] + m.consumers["KV cache (configured)"]
        assert (training > 0, engine > 0) == ((True, False) if m.rank < 64 else (False, True)), m.rank
        assert m.offloaded == {}
    assert job.sync["written"] == job.ranks[64].consumers["vLLM weights"]
    src = megatron_layout(job.spec, job.layout, 8)
    bounds = theoretical_minimum(src, vllm_layout(job.spec, 8, 32, 8).shifted(64), 2)  # bf16
    assert (job.sync["moved"], job.sync["cross"]) == (bounds["rank_min"], bounds["node_min"])
    text = format_plan(job)
    assert "pool train: ranks 0-63, roles actor, critic, reference" in text and "pool rollout: ranks 64-95" in text


def test_the_step_time_estimate_of_the_70b_pools_recipe_from_its_flops_and_bytes():
    """configs/llama2_70b_ppo_pools.yaml one-step-off, written out by hand from the model's 68,976,648,192
    parameters (the critic: the LM head's 32000 x 8192 replaced by one 8192 row and a bias): learning = 8 FLOPs per
    parameter and token (full recompute) for the actor's update, 2 for its old log-probs and for the reference (on
    the actor's 32 GPUs), 2 + 8 for the critic (its own 32 GPUs); decoding = each of the 4 TP=8 engines reading its
    weight shard per step, 64 sequences each; one-step-off overlaps the two."""
    cfg = load_config("configs/llama2_70b_ppo_pools.yaml", ["async_training.mode=one_step_off",
                                                           "algorithm.rollout_is=token_truncate"])  # fmt: skip
    job = make_plan(cfg, validate(cfg), Hardware(12, 8))
    flops = 312e12 * 0.4
    actor, critic = LLAMA2_70B_PARAMS, LLAMA2_70B_PARAMS - 32000 * 8192 + 8192 + 1
    tokens = 256 * (1024 + 1024)
    learn = (8 + 2 + 2) * actor * tokens / (32 * flops) + 10 * critic * tokens / (32 * flops)
    decode = max(actor * 2 / 8 / (2039e9 * 0.6), 2 * actor * 64 / 8 / flops)
    generate = 2 * actor * 64 * 1024 / 8 / flops + 1024 * decode
    t = job.step
    assert t.learn_s == pytest.approx(learn, rel=1e-9) and t.generate_s == pytest.approx(generate, rel=1e-9)
    assert t.sync_s == job.sync["est_s"]
    assert t.one_step_off_step_s == pytest.approx(max(learn, generate) + t.sync_s)
    assert t.sync_step_s == pytest.approx(learn + generate + t.sync_s)
    assert "one_step_off (async_training):" in format_plan(job)


def test_startup_phase_equals_the_training_state_resident_when_the_engine_starts(tiny_llama_dir, tmp_path):
    """A colocated bf16 PPO job (actor, critic, reference; Adam) at DP=2 with offload on, built as `megarl train`
    builds it: its rollout engine is started, and takes the first sync, with the offloaded state already on the host.
    The training bytes resident on each rank then (counted from the live storages) equal the planner's start-up
    phase; the engine's share of the phase is the planner's exact weights, KV cache and buffers on top."""
    from megarl.parallel.spawn import run_on_ranks
    from megarl.planner.memory import STARTUP, rank_memory
    from tests.startup_worker import run_startup

    overrides = [f"model.path={tiny_llama_dir}", f"trainer.output_dir={tmp_path}", "actor.parallel.tp=1",
                 "actor.parallel.dp=2", "algorithm.adv_estimator=gae", "model.dtype=bfloat16", "offload.enable=true",
                 "actor.optim.optimizer=adam", "critic.optim.optimizer=adam", "actor.kl_loss_coef=0.1",
                 "data.train_files=[builtin:digits]", "data.val_files=[]", "reward.function=toy_digits",
                 "rollout.backend=hf", "logging.wandb.mode=disabled", "data.train_batch_size=4",
                 "actor.global_batch_size=8", "rollout.sampling.n=2"]  # fmt: skip
    real = run_on_ranks(run_startup, 2, overrides)["per_rank"]
    cfg = load_config(None, overrides)
    spec = validate(cfg)
    planned = rank_memory(cfg, spec, ParallelLayout(dp=2), gpus_per_node=2)
    for m, seen in zip(planned, real):
        training = [c for c in m.phases[STARTUP] if c.startswith(("actor", "critic", "reference"))]
        assert training == ["actor params"] and set(m.offloaded) == {"actor grads", "actor optimizer",
                                                                     "critic params+grads+optimizer",
                                                                     "reference params"}  # fmt: skip
        assert seen == {"built": m.consumers["actor params"], "first sync": m.consumers["actor params"]}, m.rank


QWEN3_30B_A3B_LAYER = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * 768 * 2048
"""One Qwen3-30B-A3B layer: attention (q, k, v in; o out), q/k norms, two norms, the router, 128 experts x (gate, up,
down) of 768; 623,120,640 parameters. With 48 of them, embed + lm_head 2 x 151936 x 2048 and the final norm:
30,532,122,624, the model's 30.5B."""


def test_a_qwen3_moe_plan_counts_every_expert_and_prints_their_bytes(tmp_path):
    """Qwen3-30B-A3B's shapes (tests/test_reshard.py; 8 of its 48 layers) at PP=4, DP=2 (MoE trains at TP=1): the
    stages hold every parameter once, the memory table shows the routed experts' share of the actor's bytes on
    lines of their own, and the step time counts the FLOPs of the experts a token is routed to."""
    import json

    from tests.test_reshard import QWEN3_30B_A3B

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": 8}))
    cfg = load_config(RECIPE, [f"model.path={tmp_path}", "actor.parallel.tp=1", "actor.parallel.pp=4",
                               "actor.parallel.dp=2", "rollout.tp=8", "model.dtype=bfloat16"])  # fmt: skip
    job = make_plan(cfg, validate(cfg), Hardware(1, 8))
    actor = model_params(job.spec, job.layout)
    total = 2 * 151936 * 2048 + 8 * QWEN3_30B_A3B_LAYER + 2048
    assert sum(p.numel for pp in range(4) for p in actor[job.layout.rank(0, pp, 0)]) == total
    experts = 2 * 128 * 3 * 768 * 2048  # a stage's 2 layers
    assert job.ranks[0].parts == {"of which routed experts' params": 2 * experts,
                                  "of which routed experts' grads": 4 * experts}  # fmt: skip
    assert "of which routed experts' params" in format_plan(job)
    from megarl.planner.step_time import _params  # the step time's FLOPs: a token computes with 8 of 128 experts

    assert _params(job.spec, active=True) == total - 8 * 128 * 3 * 768 * 2048 * (128 - 8) // 128


def test_the_qwen3_30b_a3b_recipe_splits_its_experts_over_ep8_and_fits(capsys):
    """configs/qwen3_30b_a3b_grpo.yaml (4 nodes x 8, TP=1, DP=32, EP=8): every rank holds 16 of each layer's 128
    experts (their bf16 bytes and fp32 gradients on lines of their own), and the plan says it fits."""
    recipe = "configs/qwen3_30b_a3b_grpo.yaml"
    assert main(["plan", recipe]) == 0
    out = capsys.readouterr().out
    assert "actor TP=1 PP=1 DP=32 EP=8 (world 32)" in out and "FITS: peak" in out
    cfg = load_config(recipe, [])
    job = make_plan(cfg, validate(cfg), Hardware(4, 8), sync=False)
    experts = 48 * 16 * 3 * 768 * 2048  # 48 layers x 16 local experts x (gate, up, down) of 768 x 2048
    for rank in (0, 31):
        assert job.ranks[rank].parts == {"of which routed experts' params": 2 * experts,
                                         "of which routed experts' grads": 4 * experts}  # fmt: skip
