"""The resharding engine: Megatron (TP, PP, DP) shards -> vLLM TP shards and HF full tensors, bitwise; verification
catches corruption in transit; the executor's buffers stay within two buckets. Plans are also checked for the
byte-minimality properties on a 70B-shaped model (pure, no processes)."""

import pytest

import benchmarks.reshard as benchmark
from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.spawn import run_on_ranks
from megarl.reshard.layout import megatron_layout, vllm_layout
from megarl.reshard.plan import plan, plan_stats, theoretical_minimum
from tests.reshard_worker import run_reshard_cases

WORLD2 = [(2, 1, 1), (1, 2, 1)]
WORLD2_MOE = [(1, 1, 2), (1, 2, 1)]  # MoE trains at TP=1
WORLD4_LLAMA = [(2, 2, 1), (4, 1, 1), (2, 1, 2), (1, 2, 2)]
WORLD4_QWEN2 = [(2, 2, 1), (2, 1, 2), (1, 2, 2)]  # 2 KV heads: Megatron TP=4 is impossible, vLLM TP=4 replicates KV


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    llama = make_tiny_hf_model(
        str(root / "llama"), "llama", hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=512, seed=5
    )
    qwen2 = make_tiny_hf_model(
        str(root / "qwen2"),
        "qwen2",
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        ffn_hidden_size=512,
        tie_word_embeddings=True,
        seed=6,
    )
    qwen3 = make_tiny_hf_model(str(root / "qwen3"), "qwen3", hidden_size=256, num_heads=8, num_kv_heads=2,
                               ffn_hidden_size=512, seed=7)  # q/k norms, head_dim 64 (8 x 64 != 256)  # fmt: skip
    moe = make_tiny_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=8, moe={"mlp_only_layers": [1]})
    return {"llama": llama, "qwen2": qwen2, "qwen3_moe": moe, "qwen3": qwen3}  # the MoE model: a routed layer 0


@pytest.fixture(scope="module")
def world2(models):
    layouts = {m: WORLD2_MOE if m == "qwen3_moe" else WORLD2 for m in models}
    return run_on_ranks(run_reshard_cases, 2, {m: (d, layouts[m]) for m, d in models.items()}, [1, 2])


@pytest.fixture(scope="module")
def world4(models):
    cases = {"llama": (models["llama"], WORLD4_LLAMA), "qwen2": (models["qwen2"], WORLD4_QWEN2)}  # qwen3: world 2
    return run_on_ranks(run_reshard_cases, 4, cases, [1, 2, 4])


def _cases(results):
    return {k: v for k, v in results.items() if isinstance(k, tuple)}


def test_world2_every_destination_tensor_is_bitwise_equal(world2):
    cases = _cases(world2)
    assert len(cases) == 4 * 2 * 3  # models (llama, qwen2, qwen3, qwen3_moe) x layouts x (vLLM TP1, TP2, HF)
    for key, r in cases.items():
        assert all(m == ([], []) for m in r["mismatched"]), (key, r["mismatched"])


def test_world4_every_destination_tensor_is_bitwise_equal(world4):
    cases = _cases(world4)
    assert len(cases) == (4 + 3) * 4  # (llama + qwen2 layouts) x (vLLM TP1, TP2, TP4, HF)
    for key, r in cases.items():
        assert all(m == ([], []) for m in r["mismatched"]), (key, r["mismatched"])


def test_corruption_in_transit_names_the_tensor(world2, world4):
    for res in (world2, world4):
        msg = res["corrupt"]
        assert msg is not None and "hash mismatch" in msg and "gate_up_proj.weight" in msg and "rank 0" in msg
        full = res["corrupt_full"]  # debug mode: element-wise comparison through a separate path
        assert full is not None and "full comparison failed" in full and "gate_up_proj.weight" in full


def test_executor_buffers_stay_within_two_buckets(world4):
    m = world4["memory"]
    assert m["model_bytes"] >= 10 * m["bucket"] and m["buckets"] > 10
    assert max(m["peak_buffer_bytes"]) <= 2 * m["bucket"], m


_, LLAMA2_70B = benchmark.LLAMA2_70B  # the shapes benchmarks/reshard.py tabulates


@pytest.mark.parametrize("vllm_tp", [4, 8])
def test_70b_plan_meets_the_theoretical_minimum(vllm_tp):
    """Llama-2-70B, Megatron TP4/PP8/DP2 on 8 nodes x 8 GPUs -> vLLM TP4/TP8 on the same 64 ranks."""
    src = megatron_layout(LLAMA2_70B, ParallelLayout(tp=4, pp=8, dp=2), gpus_per_node=8)
    dst = vllm_layout(LLAMA2_70B, vllm_tp, 64, gpus_per_node=8)
    stats = plan_stats(plan(src, dst), bytes_per_element=2)
    bound = theoretical_minimum(src, dst, bytes_per_element=2)
    assert bound["node_min"] > 0
    assert stats["bytes_moved"] == bound["rank_min"]  # nothing moved twice, nothing moved that was held
    assert stats["bytes_cross_node"] <= 1.05 * bound["node_min"]
    mean_send = stats["bytes_moved"] / 64
    assert stats["max_rank_send"] <= 1.1 * mean_send  # load spread over DP replicas and receivers


def test_position_hash_is_additive_chunked_and_sensitive(monkeypatch):
    import torch

    from megarl.reshard import executor as ex

    x = torch.randn(300, 50)
    whole = ex.position_hash(x, (0, 300), (0, 50))
    left, right = (
        ex.position_hash(x[:, :20], (0, 300), (0, 20)),
        ex.position_hash(x[:, 20:], (0, 300), (20, 50)),
    )
    assert (left + right) & ex._MASK64 == whole  # pieces hashed by their senders sum to the assembled shard's hash
    monkeypatch.setattr(ex, "_HASH_CHUNK", 64)
    assert ex.position_hash(x, (0, 300), (0, 50)) == whole
    y = x.clone()
    y[7, 3] += 1e-6
    assert ex.position_hash(y, (0, 300), (0, 50)) != whole
    z = x.clone()
    z[[0, 1]] = z[[1, 0]]  # swapped rows: same values, wrong places
    assert ex.position_hash(z, (0, 300), (0, 50)) != whole
    w = x.clone()
    w[:, [0, 1]] = w[:, [1, 0]]  # swapped columns
    assert ex.position_hash(w, (0, 300), (0, 50)) != whole
    v = torch.randn(300)
    assert (ex.position_hash(v[:100], (0, 100), None) + ex.position_hash(v[100:], (100, 300), None)) & ex._MASK64 == (
        ex.position_hash(v, (0, 300), None)
    )


def test_transfers_run_on_the_accelerator_under_the_gpu_default_group(monkeypatch):
    """On GPU the default group is ``cpu:gloo,cuda:nccl`` (``default_backend``): buckets, staged layers and hashes
    belong on the rank's device, not the host. The placement guard's fake device stands in for the GPU (the CPU shim's
    own mapping answers the CPU, which could not show the difference)."""
    import torch
    import torch.distributed as dist

    from megarl.compat import cpu as cpu_compat
    from megarl.reshard import executor as ex
    from megarl.reshard import sync
    from megarl.reshard.plan import Plan

    monkeypatch.setitem(cpu_compat._state, "device", torch.device("meta"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, want in [("cpu:gloo,cuda:nccl", "meta"), ("nccl", "meta"), ("gloo", "cpu"), ("cpu:gloo", "cpu")]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert ex.comm_device().type == want, backend
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    seen = []

    def record(sub, src, dst, **kw):  # the executor's own buffers are allocated on comm_device() too
        seen.extend(t.device.type for t in dst.values())
        return ex.SyncStats()

    monkeypatch.setattr(sync, "execute", record)

    class Comm:
        rank = 0

    sub = Plan(transfers=[], padding=[], dst_shapes={0: {"model.norm.weight": (8,)}}, src_shapes={}, gpus_per_node=1)
    report = sync.SyncReport(transport="t")
    list(sync.stream_layers([sub], {}, torch.bfloat16, report, bucket_bytes=1024, verify=True, comm=Comm()))
    assert seen == ["meta"]


def test_cross_pool_exchange_on_cuda_is_one_coalesced_nccl_call():
    """Between pools on CUDA (``GroupComm.cuda``): a bucket's sends and receives are queued between
    ``_start_coalescing`` and ``_end_coalescing`` (one NCCL group call, as ``batch_isend_irecv`` makes for a
    registered group), then waited on. A recording stand-in for the NCCL process group (no GPU here)."""
    import torch

    from megarl.parallel.comm import coalesced_exchange

    calls = []

    class Work:
        def wait(self):
            calls.append(("wait",))

    class RecordingGroup:
        def _start_coalescing(self, device):
            calls.append(("start", device.type))

        def send(self, tensors, peer, tag):
            calls.append(("send", peer, tensors[0].numel()))

        def recv(self, tensors, peer, tag):
            calls.append(("recv", peer, tensors[0].numel()))

        def _end_coalescing(self, device):
            calls.append(("end", device.type))
            return Work()

    coalesced_exchange(RecordingGroup(), [(1, torch.zeros(3)), (2, torch.zeros(4))], [(1, torch.zeros(5))])
    assert calls == [("start", "cpu"), ("send", 1, 3), ("send", 2, 4), ("recv", 1, 5), ("end", "cpu"), ("wait",)]
    calls.clear()
    coalesced_exchange(RecordingGroup(), [], [])  # a rank with nothing in this bucket makes no call
    assert calls == []


QWEN3_30B_A3B = {  # the hub config's shapes (Qwen/Qwen3-30B-A3B config.json)
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip


@pytest.mark.parametrize("vllm_tp", [4, 8])
def test_moe_plan_meets_the_theoretical_minimum(vllm_tp):
    """Qwen3-30B-A3B's shapes (8 of its 48 layers), Megatron PP4/DP2 on 8 ranks (MoE trains at TP=1) -> vLLM
    TP4/TP8: every expert's slice moved once, nothing a rank holds itself."""
    from megarl.models import spec_from_hf_config

    spec = spec_from_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 8})
    src = megatron_layout(spec, ParallelLayout(tp=1, pp=4, dp=2), gpus_per_node=8)
    dst = vllm_layout(spec, vllm_tp, 8, gpus_per_node=8)
    w13 = next(s for s in dst.ranks[1] if s.name.endswith("layers.0.mlp.experts.routed_experts.w13_weight"))
    assert w13.view == (128, 2 * 768 // vllm_tp, 2048) and len(w13.blocks) == 2 * 128
    stats = plan_stats(plan(src, dst), bytes_per_element=2)
    assert stats["bytes_moved"] == theoretical_minimum(src, dst, bytes_per_element=2)["rank_min"]
