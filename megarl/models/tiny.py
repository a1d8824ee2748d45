"""Tiny random HuggingFace models and a byte-level tokenizer, built locally (tests, demo, benchmarks never download)."""

from __future__ import annotations

import os

import torch

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")

_HF_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
                      "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}  # fmt: skip
_HF_MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip
_TINY_HEAD_DIM = {"qwen3": 64, "qwen3_moe": 64}
"""Families whose tiny model has heads x head_dim != hidden (Qwen3's real models do); the others hidden / heads."""
_HF_CLASSIFIER_CLASSES = {f: c.replace("CausalLM", "SequenceClassification") for f, c in _HF_MODEL_CLASSES.items()}


CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>\\nTools (call one as <tool_call>{\"name\": ..., \"arguments\": {...}}' }}"
    "{{ '</tool_call>):' }}"
    "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}{{ '</s>' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '</s>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)
"""The byte tokenizer's chat template: ChatML-like, every message ``<|role|>\n{content}</s>`` (the end of a turn is
the EOS the model samples, so a turn the engine ended with EOS followed by new messages renders exactly as the whole
history would), tool schemas in a first system block, any role (``tool`` included). Append-only."""


def save_byte_tokenizer(out_dir: str):
    """A byte-level BPE tokenizer with no merges (256 byte tokens + pad/bos/eos) and ``CHAT_TEMPLATE``, saved for
    AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _randomize(model, seed: int, init_std: float) -> None:
    """Every parameter from N(0, init_std), norms around 1 (reproducible from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * init_std
            p.copy_(1.0 + noise if "norm" in name else noise)


TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                mlp_only_layers=[], decoder_sparse_step=1)  # fmt: skip
"""The tiny Qwen3-MoE's experts: 8 of SwiGLU width 64, top-2, probabilities renormalised, every layer sparse."""


def make_tiny_hf_model(
    out_dir: str,
    family: str = "llama",
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    ffn_hidden_size: int = 256,
    vocab_size: int = 320,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    seed: int = 0,
    init_std: float = 0.02,
    num_labels: int | None = None,
    pad_token_id: int = 0,
    moe: dict | None = None,
) -> str:
    """Write a random HF model (config.json, safetensors) and the byte tokenizer to ``out_dir``; returns it.
    ``num_labels``: a ``*ForSequenceClassification`` model (a reward model with 1) instead of a causal LM;
    ``pad_token_id``: the config's pad token (2, the EOS, for "pad = eos"). head_dim is hidden / heads (Qwen3:
    64, so heads x head_dim != hidden). ``moe``: HF config fields over ``TINY_MOE`` for a ``qwen3_moe`` model.

    Every parameter (norms and biases included) is drawn from N(0, init_std), norms around 1, so a layout
    mistake in any tensor changes the logits.
    """
    import transformers

    if family not in _HF_CONFIG_CLASSES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(_HF_CONFIG_CLASSES)}")
    config = getattr(transformers, _HF_CONFIG_CLASSES[family])(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=ffn_hidden_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        head_dim=_TINY_HEAD_DIM.get(family, hidden_size // num_heads),
        pad_token_id=pad_token_id,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        **({**TINY_MOE, **(moe or {})} if family == "qwen3_moe" else {}),
    )
    if family == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    if num_labels is not None:
        config.num_labels = num_labels
    classes = _HF_MODEL_CLASSES if num_labels is None else _HF_CLASSIFIER_CLASSES
    model = getattr(transformers, classes[family])(config)
    _randomize(model, seed, init_std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    save_byte_tokenizer(out_dir)
    return out_dir
