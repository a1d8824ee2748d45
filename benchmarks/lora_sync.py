"""LoRA weight sync: one adapter sync (vLLM's LoRA slots) vs one full-weight sync vs one merge sync (adapters merged
on the trainer side, whole weights into an engine without LoRA), time and bytes; and generation tokens/s with and
without LoRA. One run, two 2-rank spawns on the benchmark model of benchmarks/rollout.py (Megatron TP=2 actor with
adapters on every linear, one vLLM engine at TP=2 over both ranks): the first with a LoRA engine, the second with a
plain one. Also how the adapter sync's time splits: the PEFT files written to /dev/shm and read back vs the rest
(the executor and vLLM's add_lora), which bounds what an in-memory adapter load could save.

    python benchmarks/lora_sync.py            # ~2 minutes here
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from rollout import MODEL, tp2_actor  # benchmarks/rollout.py (this script's folder is on sys.path)

LORA = dict(rank=16, alpha=32)


def _median_time(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls after one warm-up, and the last call's result (collective: barriers)."""
    times, result = [], None
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        result = fn(i)
        seconds = time.perf_counter() - start
        dist.barrier()
        if i:
            times.append(seconds)
    return statistics.median(times), result


def _worker(hf_dir: str, engine_dir: str, slots: bool, num_prompts: int, new_tokens: int, repeats: int) -> dict:
    from megarl.config.schema import LoraConfig, RolloutConfig, SamplingConfig
    from megarl.lora import apply_lora
    from megarl.reshard.layout import megatron_adapter_layout, megatron_layout
    from megarl.reshard.sync import actor_tensors, push_actor
    from megarl.rollout.protocol import rollout
    from megarl.rollout.vllm_engine import VLLMEngine

    layout, spec, chunk = tp2_actor(hf_dir)
    lora = LoraConfig(**LORA)
    apply_lora(chunk, spec, lora, dist.get_rank(), 2, full=None, seed=0)
    with torch.no_grad():  # a non-zero adapter (a fresh one has B = 0)
        for name, p in chunk.named_parameters():
            if ".lora.B." in name:
                p.normal_(0, 0.01)
    cfg = RolloutConfig(kv_cache_mb=256, max_model_len=512, bucket_mb=16)
    kw = dict(lora=lora, adapter_layout=megatron_adapter_layout(spec, lora, layout, 2)) if slots else {}
    engine = VLLMEngine(cfg, engine_dir, spec, megatron_layout(spec, layout, 2), tp=2, **kw)

    syncs = {}
    if slots:
        start = time.perf_counter()
        first = push_actor(engine, chunk, 0)
        syncs["first sync (base + adapters)"] = (time.perf_counter() - start, first)
        syncs["adapter sync"] = _median_time(lambda v: push_actor(engine, chunk, v + 1), repeats)
        io = _file_io(engine.adapters.request.lora_path, repeats)
    else:
        base = actor_tensors(chunk, merge_lora=False)  # the frozen base: a model without adapters, synced whole
        syncs["full-weight sync"] = _median_time(lambda v: engine.update_weights(base, v), repeats)
        syncs["merge sync"] = _median_time(lambda v: push_actor(engine, chunk, v), repeats)
        io = None

    gen = torch.Generator().manual_seed(0)
    prompts = [
        [int(t) for t in torch.randint(3, 259, (int(n),), generator=gen)]
        for n in torch.randint(16, 64, (num_prompts,), generator=gen)
    ]
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=new_tokens, seed=3)

    def generate(step):
        out, _ = rollout(engine, prompts, step=step, sampling=sampling, seed=0)
        return sum(len(s.token_ids) for s in out)

    seconds, tokens = _median_time(generate, repeats)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: (s, r.bytes_received + r.bytes_local, r.bytes_sent) for k, (s, r) in
                                      syncs.items()})  # fmt: skip
    return {"syncs": everyone, "tokens_per_s": tokens / seconds, "io": io}


def _file_io(path: str, repeats: int) -> dict:
    """Seconds to write the current adapter (PEFT files) to /dev/shm and to read it back, as the sync does."""
    import shutil

    from safetensors.torch import load_file

    from megarl.config.schema import LoraConfig
    from megarl.lora.peft_io import WEIGHTS_FILE, write_peft_adapter

    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    out = f"{path}-bench"
    writes, reads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        write_peft_adapter(out, tensors, LoraConfig(**LORA))
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_file(os.path.join(out, WEIGHTS_FILE))
        reads.append(time.perf_counter() - start)
    shutil.rmtree(out, ignore_errors=True)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"write": statistics.median(writes), "read": statistics.median(reads), "bytes": size}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="hidden, heads and FFN sizes times this (model size ~ x^2)")
    args = ap.parse_args(argv)
    model = {**MODEL, **{k: MODEL[k] * args.scale for k in ("hidden_size", "num_heads", "num_kv_heads",
                                                            "ffn_hidden_size")}}  # fmt: skip

    from megarl.models import read_hf_config
    from megarl.models.tiny import make_tiny_hf_model
    from megarl.parallel.spawn import run_on_ranks
    from megarl.rollout import write_engine_dir

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_hf_model(os.path.join(tmp, "model"), "llama", **model)
        engine_dir = write_engine_dir(read_hf_config(hf_dir), hf_dir, os.path.join(tmp, "engine"))
        common = (args.prompts, args.new_tokens, args.repeats)
        res = {slots: run_on_ranks(_worker, 2, hf_dir, engine_dir, slots, *common) for slots in (True, False)}

    mib = 1024**2
    print(f"model: llama {model}, LoRA {LORA} on every linear, fp32, Megatron TP=2 -> one vLLM engine at TP=2, "
          "2 gloo ranks")  # fmt: skip
    print(f"\n## One sync (median of {args.repeats} after a warm-up; the first sync once), per rank")
    print(f"{'sync':30} {'rank':>4} {'seconds':>8} {'/full':>6} {'recv+local MiB':>14} {'sent MiB':>9}")
    for rank in range(2):
        rows = {**res[True]["syncs"][rank], **res[False]["syncs"][rank]}
        full = rows["full-weight sync"][0]
        for label, (seconds, received, sent) in rows.items():
            print(f"{label:30} {rank:4d} {seconds:8.4f} {seconds / full:6.2f} {received / mib:14.2f} {sent / mib:9.2f}")
    io = res[True]["io"]
    adapter_s = res[True]["syncs"][0]["adapter sync"][0]
    print(f"\nadapter sync's file I/O (rank 0, {io['bytes'] / mib:.2f} MiB): write {io['write'] * 1e3:.1f} ms, read "
          f"{io['read'] * 1e3:.1f} ms (read twice: the check and vLLM's loader) = "
          f"{(io['write'] + 2 * io['read']) / adapter_s:.0%} of the adapter sync")  # fmt: skip
    print(f"\n## Generation ({args.prompts} prompts x {args.new_tokens} new tokens, median of {args.repeats})")
    plain = res[False]["tokens_per_s"]
    print(f"{'engine':32} {'tokens/s':>9} {'/plain':>7}")
    print(f"{'vLLM without LoRA':32} {plain:9.1f} {1.0:7.2f}")
    lora_tps = res[True]["tokens_per_s"]
    print(f"{'vLLM with LoRA slots (adapter)':32} {lora_tps:9.1f} {lora_tps / plain:7.2f}")


if __name__ == "__main__":
    main()
