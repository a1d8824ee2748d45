"""Command lines of the three conversion tools (checkpoints_tools/*.py and `megarl convert ...` call these). Each
checks its arguments with file names and JSON first (a bad path, layout or output folder is one line, before torch
loads), then imports the conversion."""

from __future__ import annotations

import argparse
import sys

from megarl.checkpoint.format import CheckpointError, latest_iteration_dir, read_meta
from megarl.config.validate import layout_errors
from megarl.convert.checks import ConversionError, check_export_dir, check_output_dir
from megarl.models.spec import read_hf_config, spec_from_hf_config
from megarl.parallel.layout import ParallelLayout


def _layout_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size used to {what} (default 1)")
    parser.add_argument("--pp", type=int, default=1, help=f"pipeline-parallel size used to {what} (default 1)")
    parser.add_argument("--ep", type=int, default=1, help=f"expert-parallel size used to {what} (default 1; MoE "
                        "models; as many data-parallel ranks, so tp x pp x ep processes)")  # fmt: skip


def _layout(args) -> ParallelLayout:
    """The layout of ``--tp/--pp/--ep``: EP sits inside data parallelism, so ``ep`` data-parallel ranks."""
    return ParallelLayout(tp=args.tp, pp=args.pp, dp=args.ep, ep=args.ep)


def _check_layout(spec, args) -> None:
    """``--tp``, ``--pp`` and ``--ep``: at least 1, and dividing the model (``ConversionError`` naming the sizes that
    do)."""
    if args.tp < 1 or args.pp < 1 or args.ep < 1:
        raise ConversionError(f"--tp, --pp and --ep must be >= 1 (got --tp {args.tp} --pp {args.pp} --ep {args.ep})")
    errors = layout_errors(spec, args.tp, args.pp, option="--{}", ep=args.ep)
    if errors:
        raise ConversionError("; ".join(errors))


def _fail(tool: str, message: str) -> int:
    print(f"megarl: {tool}: {message}", file=sys.stderr)
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
    try:  # refuse bad input before any process starts
        spec = spec_from_hf_config(read_hf_config(args.hf_dir))
        check_output_dir(args.out, args.overwrite)
        _check_layout(spec, args)
        from megarl.convert import hf_to_megatron  # here: the checks above passed (this loads torch and megatron)

        hf_to_megatron.check_hf_source(args.hf_dir)  # the tensors and the tokenizer
    except (ConversionError, FileNotFoundError, ValueError) as e:
        return _fail("hf-to-megatron", str(e))
    layout = _layout(args)
    meta = hf_to_megatron.convert_on_ranks(args.hf_dir, args.out, layout, args.dtype, args.overwrite)
    print(f"wrote {meta['family']} checkpoint to {args.out} (dtype {meta['dtype']}, written at {layout})")
    return 0


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
        holds_lora = bool(meta.get("lora"))  # the actor.lora it was written with (megarl.lora.export.checkpoint_lora)
        if holds_lora and not (args.lora or args.merge):
            raise ConversionError(f"{args.ckpt} holds LoRA adapters: export them with --lora (a PEFT adapter) or "
                                  "--merge (the base with the adapters merged in)")  # fmt: skip
        if not holds_lora and (args.lora or args.merge):
            raise ConversionError(f"{args.ckpt} is a whole model, not LoRA adapters: export it without --lora/--merge")
        if args.lora or args.merge:
            from megarl.lora import export as lora_export  # here: the checks above passed (this loads torch)

            (lora_export.export_adapter if args.lora else lora_export.export_merged)(args.ckpt, args.out)
            print(f"wrote {'PEFT adapter' if args.lora else 'merged HF model'} to {args.out}")
            return 0
    except (CheckpointError, ConversionError) as e:
        return _fail("megatron-to-hf", str(e))
    from megarl.convert import megatron_to_hf  # here: after the checks (this loads torch and megatron)

    megatron_to_hf.export_on_a_rank(args.ckpt, args.out, args.overwrite, int(args.max_shard_gb * 2**30))
    print(f"wrote HF model to {args.out}")
    return 0


def verify_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="verify", description="logit parity between a HF model and a megarl checkpoint")
    p.add_argument("--hf-dir", required=True, help="HF model directory (the reference)")
    p.add_argument("--ckpt", required=True, help="megarl checkpoint directory")
    _layout_args(p, "load the checkpoint")
    args = p.parse_args(argv)
    try:
        read_hf_config(args.hf_dir)
        _check_layout(spec_from_hf_config(read_meta(args.ckpt)["hf_config"]), args)
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # ConversionError among them
        return _fail("verify", str(e))
    from megarl.convert import verify  # here: after the checks (this loads torch, megatron and transformers)

    layout = _layout(args)
    r = verify.verify_on_ranks(args.hf_dir, args.ckpt, layout)
    verdict = "PASS" if r["passed"] else "FAIL"
    print(
        f"{verdict}: max abs logit diff {r['max_abs_diff']:.3e}, max rel diff {r['max_rel_diff']:.3e} "
        f"(tolerance {r['tolerance']:.0e}) at {r['layout']} on tokens {r['tokens']}"
    )
    return 0 if r["passed"] else 1


COMMANDS = {"hf-to-megatron": hf_to_megatron_main, "megatron-to-hf": megatron_to_hf_main, "verify": verify_main}
