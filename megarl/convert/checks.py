"""The conversion tools' checks that read only file names and JSON (no torch: a bad path, layout or output folder is
refused in one line before the conversion's libraries load)."""

from __future__ import annotations

import os

from megarl.checkpoint import format as ckpt


class ConversionError(ValueError):
    """Input or output refused before anything is written."""


def check_output_dir(out_dir: str, overwrite: bool) -> None:
    """``--out`` of a conversion into megarl's format: new, empty, or a checkpoint that ``overwrite`` replaces."""
    if not os.path.exists(out_dir):
        return
    if ckpt.holds_checkpoint(out_dir):
        if not overwrite:
            raise ConversionError(f"{out_dir} already holds a checkpoint; pass --overwrite to replace it")
        return
    if os.listdir(out_dir):
        raise ConversionError(f"{out_dir} exists, is not empty and is not a megarl checkpoint; choose another --out")


def check_export_dir(out_dir: str, overwrite: bool) -> None:
    """``--out`` of an export to HF: new or empty, unless ``overwrite``."""
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConversionError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")
