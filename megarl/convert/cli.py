"""Command lines of the three conversion tools (checkpoints_tools/*.py and `megarl convert ...` call these)."""

from __future__ import annotations

import argparse
import sys

from megarl.checkpoint.format import CheckpointError, latest_iteration_dir, read_meta
from megarl.config.validate import layout_errors
from megarl.convert.hf_to_megatron import ConversionError, check_hf_source, check_output_dir, convert_hf_to_megatron
from megarl.convert.megatron_to_hf import check_export_dir, convert_megatron_to_hf
from megarl.convert.verify import verify_checkpoint
from megarl.lora.export import checkpoint_lora, export_adapter, export_merged
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.spawn import run_on_ranks


def _layout_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size used to {what} (default 1)")
    parser.add_argument("--pp", type=int, default=1, help=f"pipeline-parallel size used to {what} (default 1)")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def hf_to_megatron_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hf_to_megatron", description="HF checkpoint -> megarl/Megatron distributed checkpoint (any TP/PP later)"
    )
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    _layout_args(p, "build the model while writing (the checkpoint itself loads at any TP/PP)")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: the HF config's)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    args = p.parse_args(argv)
    try:
        _, spec = check_hf_source(args.hf_dir)  # refuse bad input before any process starts
        check_output_dir(args.out, args.overwrite)
        if args.tp < 1 or args.pp < 1:
            raise ConversionError(f"--tp and --pp must be >= 1 (got --tp {args.tp} --pp {args.pp})")
        errors = layout_errors(spec, args.tp, args.pp, option="--{}")
        if errors:
            raise ConversionError("; ".join(errors))
    except ConversionError as e:
        return _fail(str(e))
    layout = ParallelLayout(tp=args.tp, pp=args.pp)
    meta = run_on_ranks(_convert, layout.world_size, args.hf_dir, args.out, layout, args.dtype, args.overwrite)
    print(f"wrote {meta['family']} checkpoint to {args.out} (dtype {meta['dtype']}, written at {layout})")
    return 0


def _convert(hf_dir, out, layout, dtype, overwrite):
    return convert_hf_to_megatron(hf_dir, out, layout, dtype=dtype, overwrite=overwrite)


def megatron_to_hf_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron_to_hf", description="megarl/Megatron checkpoint -> HF directory")
    p.add_argument("--ckpt", required=True, help="megarl checkpoint directory (loads what 'latest' names)")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors file (default 2 GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--lora", action="store_true", help="a LoRA checkpoint's adapters as a PEFT adapter directory")
    kind.add_argument("--merge", action="store_true", help="a LoRA checkpoint merged into its base, as a HF model")
    args = p.parse_args(argv)
    try:
        meta = read_meta(args.ckpt)
        latest_iteration_dir(args.ckpt)
        check_export_dir(args.out, args.overwrite)
        lora = checkpoint_lora(meta)
        if lora is not None and not (args.lora or args.merge):
            raise ConversionError(f"{args.ckpt} holds LoRA adapters: export them with --lora (a PEFT adapter) or "
                                  "--merge (the base with the adapters merged in)")  # fmt: skip
        if lora is None and (args.lora or args.merge):
            raise ConversionError(f"{args.ckpt} is a whole model, not LoRA adapters: export it without --lora/--merge")
        if args.lora:
            export_adapter(args.ckpt, args.out)
            print(f"wrote PEFT adapter to {args.out}")
            return 0
        if args.merge:
            export_merged(args.ckpt, args.out)
            print(f"wrote merged HF model to {args.out}")
            return 0
    except (CheckpointError, ConversionError) as e:
        return _fail(str(e))
    run_on_ranks(_export, 1, args.ckpt, args.out, args.overwrite, int(args.max_shard_gb * 2**30))
    print(f"wrote HF model to {args.out}")
    return 0


def _export(ckpt, out, overwrite, max_shard_bytes):
    return convert_megatron_to_hf(ckpt, out, overwrite=overwrite, max_shard_bytes=max_shard_bytes)


def verify_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="verify", description="logit parity between a HF model and a megarl checkpoint")
    p.add_argument("--hf-dir", required=True, help="HF model directory (the reference)")
    p.add_argument("--ckpt", required=True, help="megarl checkpoint directory")
    _layout_args(p, "load the checkpoint")
    args = p.parse_args(argv)
    try:
        errors = layout_errors(spec_from_hf_config(read_meta(args.ckpt)["hf_config"]), args.tp, args.pp, "--{}")
        if errors:
            raise CheckpointError("; ".join(errors))
    except CheckpointError as e:
        return _fail(str(e))
    layout = ParallelLayout(tp=args.tp, pp=args.pp)
    r = run_on_ranks(verify_checkpoint, layout.world_size, args.hf_dir, args.ckpt, layout)
    verdict = "PASS" if r["passed"] else "FAIL"
    print(
        f"{verdict}: max abs logit diff {r['max_abs_diff']:.3e}, max rel diff {r['max_rel_diff']:.3e} "
        f"(tolerance {r['tolerance']:.0e}) at {r['layout']} on tokens {r['tokens']}"
    )
    return 0 if r["passed"] else 1


COMMANDS = {"hf-to-megatron": hf_to_megatron_main, "megatron-to-hf": megatron_to_hf_main, "verify": verify_main}
