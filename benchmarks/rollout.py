"""Rollout throughput (vLLM vs HF generate) and weight-update cost per transport, side by side in one run.

Two spawned gloo ranks, colocated as in training: a Megatron actor at TP=2, one vLLM engine at TP=2 over both ranks
(external_launcher) and an HF engine per rank. The same prompts and sampling for both engines (the HF engines each
take half of the prompts, as the data contract assigns them). Weight updates go through the resharding engine into
each transport; bytes, the executor's buffer peak, the staged layer, and the process's peak RSS growth during the
update (sampled every millisecond; for the full reload it includes the layer vLLM buffers internally) are reported.
"HF after sleep" is the HF engine's sync as a training step has it: the engine slept (its weights' memory freed)
while the actor trained.

    python benchmarks/rollout.py            # ~2-3 minutes here
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, ffn_hidden_size=1408, init_std=0.05)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident-set growth over the body, sampled on a thread every millisecond."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, _rss())
                time.sleep(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base


def tp2_actor(hf_dir: str):
    """Collective over 2 ranks: (layout, spec, chunk) of the benchmark's Megatron actor at TP=2, loaded from HF."""
    from megarl.convert.hf_to_megatron import load_hf_into_chunk
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.builder import build_model_chunk
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp=2)
    init_distributed(layout, seed=1)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    chunk = build_model_chunk(spec, layout, init_weights=False)
    load_hf_into_chunk(chunk, hf_dir, spec, layout, dist.get_rank(), progress=False)
    return layout, spec, chunk


def _worker(hf_dir: str, engine_dir: str, num_prompts: int, new_tokens: int, repeats: int) -> dict:
    from megarl.config.schema import RolloutConfig, SamplingConfig
    from megarl.reshard.layout import megatron_layout
    from megarl.reshard.sync import actor_tensors
    from megarl.rollout.hf_engine import HFEngine
    from megarl.rollout.protocol import rollout
    from megarl.rollout.vllm_engine import VLLMEngine

    layout, spec, chunk = tp2_actor(hf_dir)
    src = megatron_layout(spec, layout, gpus_per_node=2)
    cfg = RolloutConfig(kv_cache_mb=256, max_model_len=512, bucket_mb=16)
    vllm = VLLMEngine(cfg, engine_dir, spec, src, tp=2)
    hf = HFEngine(cfg, engine_dir, spec, src)
    tensors = actor_tensors(chunk)

    updates = {}
    for label, fn in (
        ("vLLM shard_write", lambda v: vllm.update_weights(tensors, v, transport="shard_write")),
        ("vLLM full_reload", lambda v: vllm.update_weights(tensors, v, transport="full_reload")),
        ("HF model write", lambda v: hf.update_weights(tensors, v)),
        ("HF after sleep", lambda v: (hf.sleep(), hf.update_weights(tensors, v))[1]),  # a step's sleep, then sync
    ):
        rows = []
        for v in range(repeats + 1):  # the first update of each transport is a warm-up (allocations), not counted
            dist.barrier()
            with PeakRSS() as mem:
                start = time.perf_counter()
                report = fn(v)
                seconds = time.perf_counter() - start
            dist.barrier()
            if v:
                rows.append((seconds, mem.growth, report))
        updates[label] = {
            "seconds": statistics.median(r[0] for r in rows),
            "rss_growth": max(r[1] for r in rows),
            "received": rows[-1][2].bytes_received + rows[-1][2].bytes_local,
            "executor_peak": rows[-1][2].peak_buffer_bytes,
            "staged_layer": rows[-1][2].peak_staging_bytes,
        }

    gen = torch.Generator().manual_seed(0)
    prompts = [
        [int(t) for t in torch.randint(3, 259, (int(n),), generator=gen)]
        for n in torch.randint(16, 64, (num_prompts,), generator=gen)
    ]  # noqa: E501
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=new_tokens, seed=3)
    throughput = {}
    for label, engine in (("vLLM (TP2, 1 engine)", vllm), ("HF generate (2 engines)", hf)):
        samples = []
        for step in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            out, _ = rollout(engine, prompts, step=step, sampling=sampling, seed=0)
            seconds = time.perf_counter() - start
            samples.append((sum(len(s.token_ids) for s in out) / seconds, seconds))
        throughput[label] = {"tokens_per_s": statistics.median(s[0] for s in samples),
                             "seconds": statistics.median(s[1] for s in samples)}  # fmt: skip
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, updates)
    return {"updates": everyone, "throughput": throughput, "params": sum(t.numel() for t in tensors.values())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from megarl.models import read_hf_config
    from megarl.models.tiny import make_tiny_hf_model
    from megarl.parallel.spawn import run_on_ranks
    from megarl.rollout import write_engine_dir

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_hf_model(os.path.join(tmp, "model"), "llama", **MODEL)
        engine_dir = write_engine_dir(read_hf_config(hf_dir), hf_dir, os.path.join(tmp, "engine"))
        res = run_on_ranks(_worker, 2, hf_dir, engine_dir, args.prompts, args.new_tokens, args.repeats)

    mib = 1024**2
    print(f"model: llama {MODEL}, {res['params'] / 1e6:.1f}M parameters per actor rank (TP=2), fp32, 2 gloo ranks")
    print(f"\n## Rollout throughput ({args.prompts} prompts x {args.new_tokens} new tokens, median of "
          f"{args.repeats})")  # fmt: skip
    base = res["throughput"]["vLLM (TP2, 1 engine)"]["tokens_per_s"]
    print(f"{'engine':26} {'tokens/s':>9} {'seconds':>8} {'/vLLM':>6}")
    for label, t in res["throughput"].items():
        print(f"{label:26} {t['tokens_per_s']:9.1f} {t['seconds']:8.2f} {t['tokens_per_s'] / base:6.2f}")
    print(f"\n## One weight update per transport (median of {args.repeats} after a warm-up; per rank)")
    print(f"{'transport':18} {'rank':>4} {'seconds':>8} {'/shard':>7} {'recv+local MiB':>14} {'exec peak MiB':>13}"
          f" {'staged MiB':>10} {'peak RSS +MiB':>13}")  # fmt: skip
    for rank, updates in enumerate(res["updates"]):
        t0 = updates["vLLM shard_write"]["seconds"]
        for label, u in updates.items():
            print(
                f"{label:18} {rank:4d} {u['seconds']:8.3f} {u['seconds'] / t0:7.2f} {u['received'] / mib:14.2f}"
                f" {u['executor_peak'] / mib:13.2f} {u['staged_layer'] / mib:10.2f} {u['rss_growth'] / mib:13.1f}"
            )


if __name__ == "__main__":
    main()
