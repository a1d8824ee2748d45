"""Prompt datasets: JSONL / Parquet / built-in records, chat templates, overlong filtering, a seeded epoch stream."""

from megarl.data.dataset import DataError, Prompt, PromptDataset, PromptSampler, check_files, read_records

__all__ = ["DataError", "Prompt", "PromptDataset", "PromptSampler", "check_files", "read_records"]
