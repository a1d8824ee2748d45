"""Cross-field validation that needs no process group: run it before launching or initialising anything."""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.schema import MegarlConfig
from megarl.models.spec import ModelSpec, read_hf_config, spec_from_hf_config
from megarl.parallel.layout import ParallelLayout


def validate(cfg: MegarlConfig, world_size: int | None = None, spec: ModelSpec | None = None) -> ModelSpec:
    """Check the config against itself, the model's HF config and (if known) the launched world size.

    Returns the ModelSpec so callers do not read the HF config twice. Raises ConfigError naming key and fix.
    """
    if spec is None:
        try:
            spec = spec_from_hf_config(read_hf_config(cfg.model.path), cfg.model.vocab_pad_multiple)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model.path: {e}") from None
    par = cfg.actor.parallel
    layout = ParallelLayout(tp=par.tp, pp=par.pp, dp=par.dp)
    errors = []
    if world_size is not None and world_size != layout.world_size:
        errors.append(
            f"actor.parallel: tp x pp x dp = {par.tp} x {par.pp} x {par.dp} = {layout.world_size}, but {world_size} "
            f"ranks were launched; launch {layout.world_size} ranks or change tp/pp/dp so their product is {world_size}"
        )
    divisibility = [
        ("tp", par.tp, spec.num_heads, "attention heads"),
        ("tp", par.tp, spec.num_kv_heads, "key/value heads (query groups)"),
        ("tp", par.tp, spec.ffn_hidden_size, "ffn (intermediate) size"),
        ("pp", par.pp, spec.num_layers, "layers"),
    ]
    for name, degree, count, what in divisibility:
        if count % degree:
            errors.append(
                f"actor.parallel.{name}={degree} does not divide the model's {count} {what}; "
                f"use a {name} in {_divisors(count)}"
            )
    if spec.padded_vocab_size % par.tp:
        errors.append(
            f"model.vocab_pad_multiple={cfg.model.vocab_pad_multiple} gives a padded vocabulary of "
            f"{spec.padded_vocab_size} rows, not divisible by actor.parallel.tp={par.tp}; use a multiple of {par.tp}"
        )
    per_step = par.dp * cfg.actor.micro_batch_size
    if cfg.actor.global_batch_size % per_step:
        errors.append(
            f"actor.global_batch_size={cfg.actor.global_batch_size} is not divisible by dp x micro_batch_size = "
            f"{par.dp} x {cfg.actor.micro_batch_size} = {per_step}; use a multiple of {per_step}"
        )
    if cfg.actor.seq_length > spec.max_position_embeddings:
        errors.append(
            f"actor.seq_length={cfg.actor.seq_length} exceeds the model's max_position_embeddings="
            f"{spec.max_position_embeddings}; lower actor.seq_length"
        )
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return spec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
