"""ModelSpec: the architecture megarl needs, read once from a HuggingFace config and checked against its family."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from megarl.models.family import ModelFamily, UnsupportedModelError, family_for_hf_config

DEFAULT_VOCAB_PAD_MULTIPLE = 128
"""megarl pads the vocabulary to a multiple that does not depend on TP, so checkpoints keep one global shape."""


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The parameter dtypes a model is built in (``model.dtype``), with their bytes per element."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer (Llama/Qwen2/Mistral/Qwen3/Qwen3-MoE style), independent of any parallel layout."""

    family: str
    """Registry name of the model family (``llama``, ``qwen2``, ``mistral``, ``qwen3``, ``qwen3_moe``)."""
    hidden_size: int
    """Model width."""
    num_layers: int
    """Number of transformer layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (query groups); equal to num_heads without GQA."""
    head_dim: int
    """Per-head width."""
    ffn_hidden_size: int
    """SwiGLU intermediate size (per gate/up half)."""
    vocab_size: int
    """True vocabulary size (the tokenizer's)."""
    padded_vocab_size: int
    """Vocabulary rows held by embedding and output layer (vocab_size rounded up to the pad multiple)."""
    max_position_embeddings: int
    """Longest sequence the positional encoding is configured for."""
    rope_theta: float
    """RoPE base."""
    rope_scaling_factor: float | None
    """Llama-3 style RoPE scaling factor, or None for plain RoPE."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    tie_word_embeddings: bool
    """Output layer shares the input embedding."""
    qkv_bias: bool
    """Q/K/V projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm ([head_dim] weights) on queries and keys before RoPE (Qwen3)."""
    moe_layers: tuple[int, ...] = ()
    """Per layer 1 for a routed-expert MLP, 0 for a dense one; () for a dense model (Qwen3-MoE:
    ``ModelFamily.moe_layers``)."""
    num_experts: int = 0
    """Routed experts per MoE layer (HF ``num_experts``, ``num_local_experts`` in memory)."""
    moe_top_k: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 0
    """One expert's SwiGLU intermediate size (HF ``moe_intermediate_size``)."""
    moe_norm_topk_prob: bool = False
    """The top-k routing probabilities are renormalised to sum to 1 (HF ``norm_topk_prob``)."""
    score_head: bool = False
    """A reward model (HF ``*ForSequenceClassification``, one label): the output layer is a scalar head without bias
    holding HF's ``score.weight``, not the language-model head."""

    @property
    def kv_channels(self) -> int:
        return self.head_dim

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    def routed(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts (else a dense SwiGLU)."""
        return bool(self.moe_layers) and bool(self.moe_layers[layer])

    @property
    def routed_layers(self) -> list[int]:
        """The indices of the layers with routed experts, in order."""
        return [i for i in range(self.num_layers) if self.routed(i)]

    def ep_refusal(self, ep: int) -> str | None:
        """Why this model cannot split its experts over ``ep`` ranks (None: it can)."""
        if ep == 1:
            return None
        if not self.is_moe:
            return f"{self.family} has no routed experts to split; use ep=1"
        if self.num_experts % ep:
            fits = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            return f"does not divide the model's {self.num_experts} experts; use an ep in {fits}"
        return None

    def to_dict(self) -> dict:
        return asdict(self)


def pad_vocab(vocab_size: int, multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def read_hf_config(model_dir: str) -> dict:
    """Read ``config.json`` from a HuggingFace model directory, with an actionable error when it is missing."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no HuggingFace config at {path}: not an HF model directory "
            f"(for a tiny local model run `megarl tiny-model --out {model_dir}`)"
        )
    with open(path) as f:
        return json.load(f)


def spec_from_hf_config(hf: dict, vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE) -> ModelSpec:
    """Build a ModelSpec from a HF config dict; refuses architectures and options megarl does not support."""
    family: ModelFamily = family_for_hf_config(hf)
    family.check_supported(hf)
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    head_dim = family.head_dim(hf)
    return ModelSpec(
        family=family.name,
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        padded_vocab_size=pad_vocab(hf["vocab_size"], vocab_pad_multiple),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(_rope_theta(hf)),
        rope_scaling_factor=family.rope_scaling_factor(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) and not _score_head(hf),  # no LM head to tie
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        score_head=_score_head(hf),
        **_experts(family, hf),
    )


def _experts(family: ModelFamily, hf: dict) -> dict:
    """The ModelSpec's expert fields of ``hf`` (none for a dense family)."""
    layers = family.moe_layers(hf)
    if not any(layers):
        return {}
    return dict(
        moe_layers=layers,
        num_experts=hf.get("num_experts", hf.get("num_local_experts")),  # hub configs / transformers' attribute
        moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def _score_head(hf: dict) -> bool:
    """Whether ``hf`` describes a sequence-classification model; refuses one with other than one label."""
    if not any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or ()):
        return False
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default is 2 labels
    if labels != 1:
        raise UnsupportedModelError(
            f"{hf['architectures'][0]} with {labels} labels: a reward model has one (a scalar score); num_labels "
            "must be 1"
        )
    return True


def _rope_theta(hf: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters; accept both spellings.
    params = hf.get("rope_parameters") or {}
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))
