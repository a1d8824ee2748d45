"""Model families (HF config -> ModelSpec -> Megatron TransformerConfig) and the GPTModel builder."""

from megarl.models.family import FAMILIES, ModelFamily, UnsupportedModelError
from megarl.models.spec import ModelSpec, read_hf_config, spec_from_hf_config

__all__ = ["FAMILIES", "ModelFamily", "ModelSpec", "UnsupportedModelError", "read_hf_config", "spec_from_hf_config"]
