"""Training-checkpoint save and load on 2 spawned ranks (TP=2, fp32, Adam): size, save and load time, and what the
SHA-256 manifest costs (hashing on save, verification on load), side by side in one run.

For each model: one warm-up save with megarl's writer and one with megatron's own (``megarl/compat/checkpoint_writer``:
threads of the rank against forked writer processes, multiprocessing queues and a spawned Manager, which starts at a
process's first save; both first saves reported separately), then per repeat a save with each writer, alternated
(megarl's manifest time reported apart), a load with hash verification and a load with sizes only
(``trainer.verify_checkpoint=false``); medians.

    python benchmarks/checkpoint.py            # ~2 minutes here
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import types

MODELS = {
    "tiny (2x128)": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=256),
    "~100M (12x768)": dict(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, ffn_hidden_size=2048, vocab_size=32000
    ),  # fmt: skip
}


@contextlib.contextmanager
def _megatron_writer():
    """Saves inside use megatron-core's own writer (forked processes): megarl's patch out, its install a no-op."""
    from megarl.compat import checkpoint_writer

    install = checkpoint_writer.install
    checkpoint_writer.uninstall()
    checkpoint_writer.install = lambda: False
    try:
        yield
    finally:
        checkpoint_writer.install = install


def _worker(hf_dir: str, root: str, repeats: int) -> dict:
    import torch

    from megarl.backend.setup import make_scheduler, wrap_for_training
    from megarl.backend.step import lm_loss, make_lm_micro_batches, train_step
    from megarl.checkpoint.training import load_training, save_training
    from megarl.config.schema import OptimConfig
    from megarl.models.builder import build_model_chunk
    from megarl.models.spec import read_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp=2)
    init_distributed(layout)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    optim = OptimConfig(lr=1e-4)
    actor, opt = wrap_for_training(build_model_chunk(spec, layout), optim)
    models = types.SimpleNamespace(actor=actor, actor_optim=opt, actor_sched=make_scheduler(opt, optim), critic=None)
    train_step(actor, opt, make_lm_micro_batches(torch.randint(0, spec.vocab_size, (2, 33)), 1), lm_loss)
    params = sum(p.numel() for p in actor.parameters()) * 2  # both TP halves
    t = time.perf_counter()
    first = save_training(root, 1, models, {"step": 1})
    out = {"params": params, "first_save": time.perf_counter() - t, "bytes": first["bytes"], "save": [], "hash": [],
           "load_verified": [], "verify": [], "load_sizes_only": [], "save_megatron": []}  # fmt: skip
    with _megatron_writer():
        t = time.perf_counter()
        save_training(f"{root}-megatron", 1, models, {"step": 1}, keep_last=1)
        out["first_save_megatron"] = time.perf_counter() - t
    for i in range(repeats):
        r = save_training(root, 2 + i, models, {"step": 2 + i}, keep_last=1)
        out["save"].append(r["seconds"])
        with _megatron_writer():
            out["save_megatron"].append(
                save_training(f"{root}-megatron", 2 + i, models, {"step": 2 + i}, keep_last=1)["seconds"]
            )
        out["hash"].append(r["hash_seconds"])
        path = r["path"]
        loaded = load_training(path, models, verify_hashes=True, restore_rng=True)
        out["load_verified"].append(loaded.seconds)
        out["verify"].append(loaded.verify_seconds)
        out["load_sizes_only"].append(load_training(path, models, verify_hashes=False, restore_rng=True).seconds)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from megarl.models.tiny import make_tiny_hf_model
    from megarl.parallel.spawn import run_on_ranks

    rows = []
    for name, shape in MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            hf = make_tiny_hf_model(f"{tmp}/hf", "llama", **shape)
            r = run_on_ranks(_worker, 2, hf, f"{tmp}/ckpt", args.repeats)
        med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list)}
        rows.append((name, r, med))
    print(f"\n2 ranks (TP=2), fp32 weights + Adam state, medians of {args.repeats}; hashing split over the ranks")
    print(
        "| model | params | checkpoint | first save (megatron's writer) | save | megatron's writer | ratio "
        "| of which manifest | load (hashes) | of which verify | load (sizes only) | hashing overhead save / load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r, m in rows:
        print(f"| {name} | {r['params'] / 1e6:.1f}M | {r['bytes'] / 1e6:.1f} MB | {r['first_save']:.2f} s "
              f"({r['first_save_megatron']:.2f} s) | {m['save']:.2f} s | {m['save_megatron']:.2f} s "
              f"| {m['save'] / m['save_megatron']:.2f}x | {m['hash']:.2f} s | {m['load_verified']:.2f} s "
              f"| {m['verify']:.2f} s "
              f"| {m['load_sizes_only']:.2f} s | {m['hash'] / (m['save'] - m['hash']):.0%} / "
              f"{(m['load_verified'] - m['load_sizes_only']) / m['load_sizes_only']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
