"""Config loading (YAML + dotted overrides) and validation: every error names the key and the fix."""

import os
import re

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.schema import ParallelConfig


@pytest.fixture
def recipe(tmp_path, tiny_llama_dir):
    path = tmp_path / "job.yaml"
    path.write_text(f"model:\n  path: {tiny_llama_dir}\nactor:\n  parallel:\n    tp: 2\n  global_batch_size: 8\n")
    return str(path)


def test_yaml_and_overrides(recipe):
    cfg = load_config(
        recipe, ["actor.parallel.tp=1", "actor.parallel.dp=2", "trainer.total_steps=5", "actor.optim.lr=0.1"]
    )
    assert (cfg.actor.parallel.tp, cfg.actor.parallel.dp, cfg.trainer.total_steps) == (1, 2, 5)
    assert cfg.actor.optim.lr == 0.1
    assert isinstance(cfg.actor.parallel, ParallelConfig)
    spec = validate(cfg, world_size=2)
    assert spec.num_heads == 4


def test_shipped_quickstart_recipe_loads():
    cfg = load_config("configs/quickstart.yaml")
    assert cfg.model.path


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.paralel.tp=2", "actor.paralel: unknown key. Did you mean 'parallel'?"),
        ("foo=1", "foo: unknown key"),
        ("actor.parallel.tp=two", "actor.parallel.tp"),
        ("actor.parallel.tp=0", "actor.parallel.tp: must be >= 1"),
        ("model.dtype=fp8", "model.dtype: must be one of"),
        ("model.transformer_impl=apex", "model.transformer_impl"),
        ("actor.optim.optimizer=lion", "actor.optim.optimizer: must be 'adam' or 'sgd'"),
        ("actor.optim.lr=0", "actor.optim.lr: must be > 0"),
        ("actor.optim.clip_grad=-1", "actor.optim.clip_grad"),
        ("actor.micro_batch_size=0", "actor.micro_batch_size"),
        ("trainer.total_steps=0", "trainer.total_steps"),
        ("trainer.total_steps", "must look like key.sub=value"),
        ("actor.kl_loss_type=k1", "actor.kl_loss_type: k1 as a KL loss has expected gradient 0"),
        ("actor.kl_loss_type=k4", "actor.kl_loss_type: must be one of ('k2', 'k3', 'k3_is')"),
        ("rollout.sampling.temperature=0", "rollout.sampling.temperature: must be > 0: training needs log-prob"),
        ("rollout.val_sampling.temperature=-1", "rollout.val_sampling.temperature: must be >= 0 (0 = greedy)"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p: must be in (0, 1]"),
        ("rollout.sampling.top_k=-3", "rollout.sampling.top_k: must be >= 0"),
        ("rollout.val_sampling.max_new_tokens=0", "rollout.val_sampling.max_new_tokens: must be >= 1"),
        ("rollout.sampling.seed=-1", "rollout.sampling.seed: must be >= 0"),
    ],
)
def test_field_errors_name_the_key(recipe, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(recipe, [override])
    assert message in str(e.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], (0.2, 0.2, "k3_is")),
        (["actor.policy_loss=gspo"], (3e-4, 4e-4, "k3_is")),
        (["actor.policy_loss=gspo", "actor.clip_ratio_high=0.001"], (3e-4, 0.001, "k3_is")),
        (["actor.clip_ratio_high=0.28", "actor.kl_loss_type=k3"], (0.2, 0.28, "k3")),
    ],
)
def test_clip_ranges_follow_the_policy_loss_and_the_kl_loss_defaults_to_k3_is(recipe, overrides, expected):
    """GSPO's sequence ratio is a geometric mean near 1: its paper clips at 3e-4 / 4e-4, not PPO's 0.2."""
    a = load_config(recipe, overrides).actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.kl_loss_type) == expected


def test_validation_may_be_greedy(recipe):
    cfg = load_config(recipe, ["rollout.val_sampling.temperature=0"])
    assert cfg.rollout.val_sampling.greedy and not cfg.rollout.sampling.greedy


def test_missing_model_section():
    with pytest.raises(ConfigError, match="model: required"):
        load_config(None, [])


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ([], 4, "tp x pp x dp = 2 x 1 x 1 = 2, but 4 ranks were launched"),
        (["actor.parallel.tp=8"], None, "4 attention heads, 2 key/value heads (query groups); use a tp in [1, 2]"),
        (["actor.parallel.tp=4"], None, "does not divide the model's 2 key/value heads"),
        (["actor.parallel.pp=3"], None, "actor.parallel.pp=3 does not divide the model's 2 layers"),
        (["actor.parallel.tp=1", "actor.parallel.dp=3"], None, "actor.global_batch_size=8 is not divisible by"),
        (["actor.global_batch_size=3"], None, "use a global_batch_size that divides 8"),
        (["algorithm.adv_estimator=grpo"], None, "set rollout.sampling.n >= 2"),
        (["algorithm.adv_estimator=reinforce_pp_baseline"], None, "set rollout.sampling.n >= 2"),
        (["rollout.sampling.n=4", "algorithm.adv_estimator=reinforce_pp", "algorithm.dynamic_sampling.enable=true"],
         None, "adv_estimator=reinforce_pp learns from them: turn dynamic_sampling off or use a group estimator"),
        (["data.max_prompt_length=1000"], None, "exceeds actor.seq_length=1024"),
        (["trainer.val_every=5"], None, "data.val_files is empty"),
        (["model.vocab_pad_multiple=3", "actor.parallel.tp=2"], None, "not divisible by actor.parallel.tp=2"),
        (["actor.seq_length=4096"], None, "exceeds the model's max_position_embeddings=1024"),
        (["model.path=/nonexistent"], None, "model.path: no HuggingFace config at /nonexistent/config.json"),
        (["rollout.tp=8"], None, "rollout.tp=8 does not fit the model's 4 attention heads / 2 key/value heads"),
        (["rollout.tp=3"], 2, "rollout.tp=3 does not divide the world size 2; use a tp in [1, 2]"),
        (["rollout.max_model_len=4096"], None, "rollout.max_model_len=4096 exceeds the model's"),
        (["rollout.sampling.max_new_tokens=1024"], None, "leaves no room for a prompt"),
        (
            [
                "algorithm.overlong.enable=true",
                "algorithm.overlong.buffer_len=200",
                "rollout.sampling.max_new_tokens=128",
            ],
            None,
            "algorithm.overlong.buffer_len=200 exceeds rollout.sampling.max_new_tokens=128",
        ),
    ],
)
def test_cross_field_errors(recipe, overrides, world, message):
    cfg = load_config(recipe, overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    assert message in str(e.value)


def test_head_dim_the_cpu_vllm_backend_lacks(tmp_path):
    from megarl.models.tiny import make_tiny_hf_model

    odd = make_tiny_hf_model(str(tmp_path / "odd"), "llama", hidden_size=96, num_heads=2, num_kv_heads=2)  # head 48
    cfg = load_config(None, [f"model.path={odd}"])
    with pytest.raises(
        ConfigError, match=r"head_dim=48 is not supported by vLLM's CPU attention .* rollout.backend=hf"
    ):
        validate(cfg)
    validate(load_config(None, [f"model.path={odd}", "rollout.backend=hf"]))


def test_kv_cache_budget_must_hold_one_sequence(tmp_path):
    from megarl.models.tiny import make_tiny_hf_model

    deep = make_tiny_hf_model(str(tmp_path / "deep"), "llama", num_layers=8, num_kv_heads=4)
    cfg = load_config(None, [f"model.path={deep}", "rollout.kv_cache_mb=1"])  # 8 KiB per token at TP 1
    with pytest.raises(
        ConfigError,
        match="rollout.kv_cache_mb=1 holds 128 tokens per engine rank, fewer than one "
        "sequence of max_model_len=1024; raise kv_cache_mb to at least 8",
    ):
        validate(cfg)
    validate(
        load_config(
            None,
            [
                f"model.path={deep}",
                "rollout.kv_cache_mb=1",
                "rollout.max_model_len=128",
                "rollout.sampling.max_new_tokens=64",
                "data.max_prompt_length=64",
            ],
        )
    )


def test_all_errors_reported_at_once(recipe):
    cfg = load_config(recipe, ["actor.parallel.tp=8", "actor.parallel.pp=3"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "actor.parallel.tp=8" in str(e.value) and "actor.parallel.pp=3" in str(e.value)


def test_gspo_is_a_mean_over_sequences(recipe):
    """GSPO's policy loss is aggregated seq-mean-token-mean whatever the default; another explicit mode is refused."""
    gspo = load_config(recipe, ["actor.policy_loss=gspo"]).actor
    assert gspo.pg_agg_mode == "seq-mean-token-mean" and gspo.agg_mode == "token-mean"  # entropy and KL: as set
    assert load_config(recipe, []).actor.pg_agg_mode == "token-mean"
    ok = load_config(recipe, ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"]).actor
    assert ok.pg_agg_mode == ok.agg_mode == "seq-mean-token-mean"
    with pytest.raises(ConfigError) as e:
        load_config(recipe, ["actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean"])
    assert "actor.loss_agg_mode: 'token-mean' with policy_loss=gspo: GSPO's objective is a mean over sequences" in str(
        e.value
    )


def test_old_logprobs_are_computed_when_the_kl_in_reward_or_sequence_rejection_needs_them(recipe):
    """One mini-batch, one epoch: the old-log-prob pass is skipped, unless the KL in the reward (it must see the
    trainer's log-probs, not the engine's) or rollout_is=seq_mask (whole sequences before the update) needs it."""
    from megarl.config.recipe import skips_old_logprob

    one = ["data.train_batch_size=1", "rollout.sampling.n=8", "actor.global_batch_size=8"]
    assert skips_old_logprob(load_config(recipe, one))
    assert not skips_old_logprob(load_config(recipe, [*one, "algorithm.kl_in_reward=true"]))
    assert not skips_old_logprob(load_config(recipe, [*one, "algorithm.rollout_is=seq_mask"]))
    assert not skips_old_logprob(load_config(recipe, [*one, "async_training.mode=one_step_off"]))


def test_async_training_modes(tiny_llama_dir):
    """one_step_off is valid on a rollout pool with the rollout correction; an unknown mode is named."""
    validate(load_config("configs/tiny_grpo_async.yaml", [f"model.path={tiny_llama_dir}"]), world_size=4)
    validate(load_config("configs/tiny_grpo_bounded.yaml", [f"model.path={tiny_llama_dir}"]), world_size=4)
    cfg = load_config("configs/tiny_grpo_bounded.yaml", [f"model.path={tiny_llama_dir}",
                                                          "async_training.partial_rollout=none"])  # fmt: skip
    assert cfg.async_training.partial_rollout == "none" and cfg.async_training.max_staleness == 2
    with pytest.raises(ConfigError, match=re.escape("async_training.mode: must be one of ('sync', 'one_step_off', ")):
        load_config("configs/tiny_grpo_async.yaml", [f"model.path={tiny_llama_dir}", "async_training.mode=async"])


def _pools(*items):
    out = []
    for name, ranks, roles in items:
        out += [f"placement.pools.{name}.ranks={ranks}", f"placement.pools.{name}.roles=[{','.join(roles)}]"]
    return out


@pytest.mark.parametrize("pools, message", [
    (_pools(("train", "0-1", ["actor"]), ("rollout", "3-4", ["rollout"])), "pools.rollout.ranks: rank 2 in no pool"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "1-2", ["rollout"])), "1-2 overlaps another pool"),
    (_pools(("train", "0-2", ["actor"]), ("rollout", "3-4", ["rollout"])), "3 ranks, but actor.parallel needs"),
    (_pools(("train", "0-1", ["actor"])), "no pool hosts the rollout"),
    (_pools(("train", "0-1", ["actor", "critic"]), ("rollout", "2-3", ["rollout"])), "builds no critic"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-4", ["rollout"])), "3 ranks are not whole engines"),
    (_pools(("train", "0-1", ["actr"])), "placement.pools.train.roles: unknown ['actr']"),
    (_pools(("train", "1-0", ["actor"])), "placement.pools.train.ranks: '1-0' is not an increasing range"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-3", ["rollout"])) + ["rollout.backend=hf"],
     "rollout.backend=hf generates on the actor's ranks"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-3", ["rollout"])) + ["offload.enable=true"],
     "offload.enable=true: with a rollout pool"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-3", ["rollout", "reference"])) + ["actor.kl_loss_coef=0.1"],
     "the reference runs beside the actor or the critic"),
    (["async_training.mode=one_step_off", "algorithm.rollout_is=token_truncate"],
     "async_training.mode=one_step_off: generation overlaps training only on ranks of its own; add a rollout pool"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-3", ["rollout"])) + ["async_training.mode=one_step_off"],
     "async_training.mode=one_step_off trains on samples generated by older weights: set algorithm.rollout_is"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-3", ["rollout"])) + [
        "async_training.mode=bounded", "algorithm.rollout_is=token_truncate", "async_training.max_staleness=1",
        "async_training.sync_every=3"], "async_training.sync_every=3 > max_staleness + 1 = 2: admission would stop"),
    (["async_training.partial_rollout=recompute"],
     "async_training.partial_rollout=recompute continues requests across weight pushes on a rollout pool's"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-3", ["rollout"])) + [
        "async_training.mode=bounded", "algorithm.rollout_is=token_truncate",
        "async_training.partial_rollout=recompute", "actor.lora.rank=4", "rollout.lora_merge=false"],
     "but a request keeps the LoRA slot it started with"),
    (_pools(("train", "0-1", ["actor"]), ("rollout", "2-3", ["rollout"])) + [
        "async_training.mode=bounded", "algorithm.rollout_is=token_truncate", "algorithm.dynamic_sampling.enable=true"],
     "async_training.mode=bounded streams every prompt group into a batch in data order"),
])  # fmt: skip
def test_placement_mistakes_are_named_before_launch(tiny_llama_dir, pools, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config("configs/tiny_grpo.yaml", [f"model.path={tiny_llama_dir}", *pools]), world_size=4)


def test_a_valid_placement_sizes_the_launch(tiny_llama_dir):
    from megarl.config.validate import launch_world_size, pools_of

    pools = _pools(("rollout", "2-3", ["rollout"]), ("train", "0-1", ["actor"]))
    cfg = load_config("configs/tiny_grpo.yaml", [f"model.path={tiny_llama_dir}", *pools])
    validate(cfg, world_size=4)
    assert [p.name for p in pools_of(cfg)] == ["train", "rollout"] and launch_world_size(cfg) == 4


def test_a_critic_pools_layout_must_divide_its_models_and_batch(tiny_llama_dir):
    """The critic's pool at critic.parallel: each Megatron model it builds (critic, reference) at that layout."""
    pools = _pools(("train", "0-1", ["actor"]), ("critic", "2-4", ["critic", "reference"]),
                   ("rollout", "5-6", ["rollout"]))  # fmt: skip
    cases = [(["critic.parallel.tp=3"], "critic.parallel.tp=3 does not divide the model's 4 attention heads"),
             (["critic.parallel.dp=3"], "critic.parallel.dp=3 does not divide actor.global_batch_size=32")]
    for extra, message in cases:
        cfg = load_config("configs/tiny_ppo.yaml", [f"model.path={tiny_llama_dir}", *pools, *extra])
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(cfg, world_size=7)


def test_auto_settings_resolve_per_device_and_explicit_values_win(tiny_llama_dir, monkeypatch):
    """A recipe that sets nothing: bf16, CUDA graphs and vLLM's own KV sizing on CUDA; fp32, eager and 1 GiB on
    CPU. What was chosen is reported; an explicit value is kept on both."""
    import torch

    from megarl.config.device_defaults import apply_tf32, kv_cache_bytes
    from megarl.config.loader import load_config_and_defaults
    from megarl.rollout import vllm_engine

    path = [f"model.path={tiny_llama_dir}"]
    gpu, chosen = load_config_and_defaults(None, path, cuda=True)
    assert (gpu.model.dtype, gpu.rollout.enforce_eager, gpu.rollout.kv_cache_mb) == ("bfloat16", False, "auto")
    assert chosen[:2] == ["model.dtype=bfloat16", "rollout.enforce_eager=false"]
    assert "gpu_memory_utilization=0.5" in chosen[2] and kv_cache_bytes(gpu.rollout, cuda=True) is None
    cpu, chosen = load_config_and_defaults(None, path, cuda=False)
    assert (cpu.model.dtype, cpu.rollout.enforce_eager, cpu.rollout.kv_cache_mb) == ("float32", True, 1024)
    assert chosen == ["model.dtype=float32", "rollout.enforce_eager=true", "rollout.kv_cache_mb=1024"]
    explicit = [*path, "model.dtype=float32", "rollout.enforce_eager=true", "rollout.kv_cache_mb=64"]
    for cuda in (True, False):
        cfg, chosen = load_config_and_defaults(None, explicit, cuda=cuda)
        assert (cfg.model.dtype, cfg.rollout.enforce_eager, cfg.rollout.kv_cache_mb, chosen) == ("float32", True,
                                                                                                   64, [])  # fmt: skip
    with pytest.raises(ConfigError, match="rollout.kv_cache_mb: must be 'auto' or a number of MiB >= 1"):
        load_config(None, [*path, "rollout.kv_cache_mb=lots"])
    # what vLLM is given on CUDA: the share of the GPU ('auto'), or the explicit cache and what is free
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * 2**30, 80 * 2**30))
    assert vllm_engine._memory_args(gpu.rollout) == {"gpu_memory_utilization": 0.5}
    assert vllm_engine._memory_args(cfg.rollout) == {"kv_cache_memory_bytes": 64 * 2**20,
                                                     "gpu_memory_utilization": 0.95 * 60 / 80}  # fmt: skip
    before = torch.get_float32_matmul_precision()
    try:
        assert apply_tf32(True) == ["fp32 matmuls on TF32"] and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert apply_tf32(False) == []


def test_plan_resolves_auto_for_gpus_on_any_machine(tiny_llama_dir, capsys):
    from megarl.cli import main

    model = f"model.path={tiny_llama_dir}"
    main(["plan", "configs/quickstart.yaml", model, "model.dtype=auto", "rollout.kv_cache_mb=auto"])
    out = capsys.readouterr().out
    assert "(bfloat16)" in out.splitlines()[0]
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner.memory import rank_memory

    cfg = load_config("configs/quickstart.yaml", [model, "rollout.kv_cache_mb=auto"], cuda=True)
    spec = spec_from_hf_config(read_hf_config(cfg.model.path))
    (m,) = rank_memory(cfg, spec, ParallelLayout(), gpus_per_node=1, gpu_bytes=80 * 10**9)
    assert m.consumers["KV cache (configured)"] == 40 * 10**9 - m.consumers["vLLM weights"] > 0  # vLLM's share


def test_a_mode_named_off_stays_a_word_in_a_recipe_and_an_override(tmp_path, tiny_llama_dir):
    """YAML 1.1 reads off/on/yes/no as booleans, which made `algorithm.rollout_is=off` 'False' (refused); recipes and
    overrides keep them as words (YAML 1.2), and a bool field still takes them."""
    recipe = tmp_path / "words.yaml"
    recipe.write_text(f"base: {os.path.abspath('configs/tiny_grpo.yaml')}\nmodel:\n  path: {tiny_llama_dir}\n"
                      "algorithm:\n  rollout_is: off\ntrainer:\n  save_samples: yes\n")  # fmt: skip
    cfg = load_config(str(recipe), ["actor.moe_routing_replay=off"])
    assert (cfg.algorithm.rollout_is, cfg.actor.moe_routing_replay, cfg.trainer.save_samples) == ("off", "off", True)
    cfg = load_config(str(recipe), ["algorithm.rollout_is=off", "trainer.save_samples=off"])
    assert (cfg.algorithm.rollout_is, cfg.trainer.save_samples) == ("off", False)
