"""Typed config tree, YAML + dotted overrides, and validation that names the fix."""

from megarl.config.loader import ConfigError, load_config, to_yaml
from megarl.config.schema import ActorConfig, MegarlConfig, ModelConfig, OptimConfig, ParallelConfig, TrainerConfig
from megarl.config.validate import validate

__all__ = [
    "ActorConfig",
    "ConfigError",
    "MegarlConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainerConfig",
    "load_config",
    "to_yaml",
    "validate",
]
