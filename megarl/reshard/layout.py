"""Where every byte of the model lives, on both sides of a weight sync, in one coordinate system: the HF tensors.

A shard (one tensor on one rank) is a list of ``Block``s: rectangles of HF tensors placed at an offset in the shard
(QKV and gate/up shards concatenate several HF tensors; padding rows have no source). Layouts are derived from the
ModelSpec, the family adapter and the parallel degrees alone, so describing a 70B model on 64 ranks takes no memory.

Sides described here:
- ``megatron_layout``: Megatron local-spec shards (megarl.parallel.megatron_shards rules) on TP x PP x DP ranks.
- ``vllm_layout``: vLLM's per-rank shards at TP=d (qkv_proj = [q_r; k_r; v_r] with KV heads replicated when
  d > KV heads, gate_up_proj = [gate_r; up_r], o_proj/down_proj split on the input dim, vocabulary padded to 64
  then split, lm_head tied to embed_tokens when the model ties them, Qwen3's per-head q/k norms whole on every rank,
  Qwen3-MoE's router whole and its fused experts split on their intermediate size).
- ``hf_layout``: full HF tensors (TP=1) on the given ranks.
Expert and context parallelism would add more split rules to the same Block description; they are not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.lora.adapters import COLUMN, MODULES, TPSlice, hf_shape, peft_key
from megarl.models.adapter import COPY, GATE_UP, QKV, VOCAB, tensor_maps
from megarl.models.spec import ModelSpec
from megarl.parallel import megatron_shards as ms
from megarl.parallel.layout import ParallelLayout

VLLM_VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE

Range = tuple[int, int]


@dataclass(frozen=True)
class Block:
    """Rows x cols of HF tensor ``hf`` placed at (row_off, col_off) in a shard. ``hf=None``: zero padding rows."""

    hf: str | None
    rows: Range
    cols: Range | None  # None: the tensor is 1-D
    row_off: int
    col_off: int

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * (1 if self.cols is None else self.cols[1] - self.cols[0])


@dataclass
class Shard:
    """One tensor on one rank."""

    name: str
    """The tensor's name on that side (Megatron local name, vLLM or HF parameter name)."""
    shape: tuple[int, ...]
    """Its shape as its blocks address it: 1-D or 2-D (a tensor of more dims is described by its row view)."""
    blocks: list[Block] = field(default_factory=list)
    view: tuple[int, ...] | None = None
    """The tensor's own shape when it has more than 2 dims (vLLM's fused experts, [E, rows, cols]): ``shape`` is
    then its row view (E * rows, cols), which a reshape turns into it."""


@dataclass
class SideLayout:
    """Every shard on every rank of one side, plus where ranks sit (for link classes)."""

    ranks: dict[int, list[Shard]]
    gpus_per_node: int

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def shifted(self, offset: int) -> SideLayout:
        """The same shards on ranks ``offset`` higher (a pool that starts at global rank ``offset``)."""
        return SideLayout({r + offset: shards for r, shards in self.ranks.items()}, self.gpus_per_node)


class _ShardBuilder:
    """Appends HF rectangles along dim 0 (``rows``) or dim 1 (``cols``) of a shard."""

    def __init__(self, name: str, ncols: int | None, concat_dim: int = 0):
        self.name, self.ncols, self.dim = name, ncols, concat_dim
        self.blocks: list[Block] = []
        self.offset = 0

    def add(self, hf: str | None, rows: Range, cols: Range | None = None) -> _ShardBuilder:
        cols = cols if cols is not None else (None if self.ncols is None else (0, self.ncols))
        if self.dim == 0:
            self.blocks.append(Block(hf, rows, cols, self.offset, 0))
            self.offset += rows[1] - rows[0]
        else:
            self.blocks.append(Block(hf, rows, cols, 0, self.offset))
            self.offset += cols[1] - cols[0]
        return self

    def build(self, view: tuple[int, ...] | None = None) -> Shard:
        if self.dim == 0:
            shape = (self.offset,) if self.ncols is None else (self.offset, self.ncols)
        else:
            shape = (self.blocks[0].rows[1] - self.blocks[0].rows[0], self.offset)
        return Shard(self.name, shape, [b for b in self.blocks if b.numel > 0], view)


def _hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, d = spec.hidden_size, spec.head_dim
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if spec.score_head:  # a reward model's scalar head
        shapes["score.weight"] = (1, h)
    elif not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (spec.num_heads * d, h),
                p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, spec.num_heads * d),
            }
        )
        shapes.update(_mlp_shapes(spec, i))
        if spec.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (spec.num_heads * d,),
                    p + "self_attn.k_proj.bias": (spec.num_kv_heads * d,),
                    p + "self_attn.v_proj.bias": (spec.num_kv_heads * d,),
                }
            )
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def _mlp_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's MLP tensors: a dense SwiGLU, or a routed-expert MLP (the router ``mlp.gate`` and each expert j's
    SwiGLU ``mlp.experts.{j}``, the hub layout)."""
    h, p = spec.hidden_size, f"model.layers.{i}.mlp."
    if not spec.routed(i):
        f = spec.ffn_hidden_size
        return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h), p + "down_proj.weight": (h, f)}
    f, shapes = spec.moe_ffn_hidden_size, {p + "gate.weight": (spec.num_experts, h)}
    for j in range(spec.num_experts):
        e = f"{p}experts.{j}."
        shapes.update({e + "gate_proj.weight": (f, h), e + "up_proj.weight": (f, h), e + "down_proj.weight": (h, f)})
    return shapes


def _cols(shape) -> int | None:
    return shape[1] if len(shape) == 2 else None


def _vocab_rows(b: _ShardBuilder, hf: str, start: int, stop: int, vocab: int) -> None:
    """Rows [start, stop) of a padded vocabulary: real rows from ``hf``, the rest zero padding."""
    real = (min(start, vocab), min(stop, vocab))
    b.add(hf, real)
    b.add(None, (0, stop - start - (real[1] - real[0])))


# --- Megatron ------------------------------------------------------------------------------------------------------
def _megatron_shard(tmap, spec: ModelSpec, hf_shapes, lname: str, tp_rank: int, tp: int) -> Shard:
    first = hf_shapes[tmap.hf[0]]
    split = ms.tp_split(tmap.megatron, value_head=spec.score_head)
    if tmap.kind == VOCAB:
        per = spec.padded_vocab_size // tp
        b = _ShardBuilder(lname, first[1])
        _vocab_rows(b, tmap.hf[0], tp_rank * per, (tp_rank + 1) * per, spec.vocab_size)
        return b.build()
    if tmap.kind == QKV:
        groups, d = spec.num_kv_heads, spec.head_dim
        qpg = spec.num_heads // groups * d
        b = _ShardBuilder(lname, _cols(first))
        per = groups // tp
        q, k, v = tmap.hf
        for g in range(tp_rank * per, (tp_rank + 1) * per):
            b.add(q, (g * qpg, (g + 1) * qpg)).add(k, (g * d, (g + 1) * d)).add(v, (g * d, (g + 1) * d))
        return b.build()
    if tmap.kind == GATE_UP:
        rows = first[0] // tp
        b = _ShardBuilder(lname, first[1])
        for hf in tmap.hf:
            b.add(hf, (tp_rank * rows, (tp_rank + 1) * rows))
        return b.build()
    assert tmap.kind == COPY
    if split == ms.COLS:
        per = first[1] // tp
        return (
            _ShardBuilder(lname, first[1], concat_dim=1)
            .add(tmap.hf[0], (0, first[0]), (tp_rank * per, (tp_rank + 1) * per))
            .build()
        )
    return _ShardBuilder(lname, _cols(first)).add(tmap.hf[0], (0, first[0])).build()


def megatron_layout(spec: ModelSpec, layout: ParallelLayout, gpus_per_node: int) -> SideLayout:
    """Megatron local-spec shards on every rank of ``layout`` (DP replicas hold identical shards)."""
    hf_shapes = _hf_shapes(spec)
    maps = tensor_maps(spec)
    ranks = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        stage = ms.StageInfo.at(layout, rank, spec)
        shards = []
        for tmap in maps:
            for lname in ms.held_names(tmap.megatron, stage, tied_embeddings=spec.tie_word_embeddings):
                shards.append(_megatron_shard(tmap, spec, hf_shapes, lname, c.tp, layout.tp))
        ranks[rank] = shards
    return SideLayout(ranks, gpus_per_node)


# --- vLLM ----------------------------------------------------------------------------------------------------------
def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def _vllm_rank_shards(spec: ModelSpec, r: int, d: int) -> list[Shard]:
    h, hd = spec.hidden_size, spec.head_dim
    vpad = vllm_padded_vocab(spec.vocab_size)
    per_vocab = vpad // d

    def vocab(name, hf):
        b = _ShardBuilder(name, h)
        _vocab_rows(b, hf, r * per_vocab, (r + 1) * per_vocab, spec.vocab_size)
        return b.build()

    out = [vocab("model.embed_tokens.weight", "model.embed_tokens.weight")]
    q_heads = spec.num_heads // d
    kv_head_lo, kv_heads = (
        (r * spec.num_kv_heads // d, spec.num_kv_heads // d)
        if d <= spec.num_kv_heads
        else (r // (d // spec.num_kv_heads), 1)
    )
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
            cols = h if suffix == "weight" else None
            b = _ShardBuilder(a + f"qkv_proj.{suffix}", cols)
            b.add(a + f"q_proj.{suffix}", (r * q_heads * hd, (r + 1) * q_heads * hd))
            for kv in "kv":
                b.add(a + f"{kv}_proj.{suffix}", (kv_head_lo * hd, (kv_head_lo + kv_heads) * hd))
            out.append(b.build())
        out.append(
            _ShardBuilder(a + "o_proj.weight", spec.num_heads * hd, 1)
            .add(a + "o_proj.weight", (0, h), (r * q_heads * hd, (r + 1) * q_heads * hd))
            .build()
        )
        out += _vllm_mlp(spec, i, r, d)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out.append(_ShardBuilder(p + norm, None).add(p + norm, (0, h)).build())
        if spec.qk_norm:  # per-head norms: whole on every rank (vLLM's Qwen3 RMSNorm(head_dim))
            for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                out.append(_ShardBuilder(p + norm, None).add(p + norm, (0, hd)).build())
    out.append(_ShardBuilder("model.norm.weight", None).add("model.norm.weight", (0, h)).build())
    if not spec.tie_word_embeddings:  # a tied lm_head is the embed_tokens parameter itself in vLLM
        out.append(vocab("lm_head.weight", "lm_head.weight"))
    return out


def _vllm_mlp(spec: ModelSpec, i: int, r: int, d: int) -> list[Shard]:
    """Layer i's MLP on vLLM TP rank r of d. Dense: ``gate_up_proj`` = [gate_r; up_r], ``down_proj`` its columns r.
    Routed experts (vLLM's fused MoE at EP = 1): the router ``mlp.gate`` whole on every rank; every expert's
    rank-r slice of its intermediate size in ``w13_weight`` [E, 2I/d, H] (per expert [gate_r; up_r]) and
    ``w2_weight`` [E, H, I/d] (per expert down's columns r), each described as its 2-D row view (``Shard.view``)."""
    h, p = spec.hidden_size, f"model.layers.{i}.mlp."
    if not spec.routed(i):
        ffn = spec.ffn_hidden_size // d
        rows = (r * ffn, (r + 1) * ffn)
        gate_up = _ShardBuilder(p + "gate_up_proj.weight", h).add(p + "gate_proj.weight", rows)
        gate_up.add(p + "up_proj.weight", rows)
        down = _ShardBuilder(p + "down_proj.weight", spec.ffn_hidden_size, 1).add(p + "down_proj.weight", (0, h), rows)
        return [gate_up.build(), down.build()]
    E, f = spec.num_experts, spec.moe_ffn_hidden_size // d
    rows = (r * f, (r + 1) * f)
    w13 = _ShardBuilder(p + "experts.routed_experts.w13_weight", h)
    w2 = _ShardBuilder(p + "experts.routed_experts.w2_weight", f)
    for j in range(E):
        e = f"{p}experts.{j}."
        w13.add(e + "gate_proj.weight", rows).add(e + "up_proj.weight", rows)
        w2.add(e + "down_proj.weight", (0, h), rows)
    router = _ShardBuilder(p + "gate.weight", h).add(p + "gate.weight", (0, E)).build()
    return [router, w13.build(view=(E, 2 * f, h)), w2.build(view=(E, h, f))]


def vllm_layout(spec: ModelSpec, tp: int, world_size: int, gpus_per_node: int) -> SideLayout:
    """vLLM shards at TP=``tp`` on ``world_size`` ranks: engines are blocks of ``tp`` consecutive ranks."""
    if (
        spec.num_heads % tp
        or (tp > spec.num_kv_heads and tp % spec.num_kv_heads)
        or (tp <= spec.num_kv_heads and spec.num_kv_heads % tp)
    ):
        raise ValueError(f"vLLM TP={tp} does not fit {spec.num_heads} heads / {spec.num_kv_heads} KV heads")
    return SideLayout({rank: _vllm_rank_shards(spec, rank % tp, tp) for rank in range(world_size)}, gpus_per_node)


def hf_layout(spec: ModelSpec, ranks: list[int], gpus_per_node: int) -> SideLayout:
    """Full HF tensors on each of ``ranks`` (e.g. an HF generate engine, or a full-reload transport)."""
    shards = [
        _ShardBuilder(name, _cols(shape)).add(name, (0, shape[0])).build() for name, shape in _hf_shapes(spec).items()
    ]
    return SideLayout({rank: shards for rank in ranks}, gpus_per_node)


# --- LoRA adapters -------------------------------------------------------------------------------------------------
# An adapter factor's coordinate is its PEFT name (megarl.lora.adapters.peft_key): rank x in for A, out x rank for B.
def megatron_adapter_layout(spec: ModelSpec, lora, layout: ParallelLayout, gpus_per_node: int) -> SideLayout:
    """The actor's adapter factors (Megatron local names ``decoder.layers.{i}.<linear>.lora.{A|B}.<target>``) on every
    rank, in the order the model registers them (per linear its A factors, then its B factors): column-parallel
    linears hold A whole and their rows of B, row-parallel ones their columns of A and B whole
    (``megarl.lora.adapters.TPSlice``)."""
    ranks = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        stage, where = ms.StageInfo.at(layout, rank, spec), TPSlice(c.tp, layout.tp)
        shards = []
        for local in range(stage.layers_per_stage):
            layer = stage.first_layer + local
            for path, (style, targets, _) in MODULES.items():
                a_shards, b_shards = [], []
                for t in (t for t in targets if t in lora.target_modules):
                    out_f, in_f = hf_shape(spec, t)
                    name = f"decoder.layers.{local}.{path}.lora.{{}}.{t}"
                    a, b = peft_key(layer, t, "A"), peft_key(layer, t, "B")
                    A = _ShardBuilder(name.format("A"), in_f, concat_dim=0 if style == COLUMN else 1)
                    B = _ShardBuilder(name.format("B"), lora.rank)
                    if style == COLUMN:
                        A.add(a, (0, lora.rank))
                        B.add(b, where.row_range(spec, t))
                    else:
                        A.add(a, (0, lora.rank), where.col_range(spec, t))
                        B.add(b, (0, out_f))
                    a_shards.append(A.build())
                    b_shards.append(B.build())
                shards += a_shards + b_shards
        ranks[rank] = shards
    return SideLayout(ranks, gpus_per_node)


def peft_adapter_layout(spec: ModelSpec, lora, ranks: list[int], gpus_per_node: int) -> SideLayout:
    """Every full adapter factor under its PEFT name on each of ``ranks`` (what vLLM's LoRA loader reads: it slices
    the factors for its own TP rank itself)."""
    shards = []
    for layer in range(spec.num_layers):
        for _, targets, _ in MODULES.values():
            for t in (t for t in targets if t in lora.target_modules):
                out_f, in_f = hf_shape(spec, t)
                for factor, (rows, cols) in (("A", (lora.rank, in_f)), ("B", (out_f, lora.rank))):
                    key = peft_key(layer, t, factor)
                    shards.append(_ShardBuilder(key, cols).add(key, (0, rows)).build())
    return SideLayout({rank: shards for rank in ranks}, gpus_per_node)
