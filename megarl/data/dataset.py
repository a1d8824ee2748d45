"""Prompt datasets: JSONL / Parquet records (or ``builtin:NAME``), tokenised once, with a seeded epoch stream."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from megarl.data.builtin import PREFIX, builtin_records

FORMATS = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """Data that cannot be used; the message names the file / record / key and the fix."""


@dataclass
class Prompt:
    """One prompt as the engine sees it."""

    index: int
    """Position in the dataset."""
    prompt_ids: list[int]
    prompt_text: str
    """The text given to the tokenizer (after the chat template, if any)."""
    ground_truth: object = None
    extras: dict = field(default_factory=dict)
    """The record's other fields (passed to the reward function)."""


def read_records(path: str, split: str = "train") -> list[dict]:
    """The records of one data file (or built-in dataset)."""
    if path.startswith(PREFIX):
        try:
            return builtin_records(path, split)
        except ValueError as e:
            raise DataError(str(e)) from None
    if not os.path.isfile(path):
        raise DataError(
            f"data file not found: {path}; set data.train_files / data.val_files to existing JSONL or Parquet files"
        )
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith((".jsonl", ".json")):
        records = []
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: not a JSON object ({e.msg}); one object per line") from None
        return records
    raise DataError(f"{path}: unsupported format; use one of {FORMATS} (or builtin:NAME)")


def _field(record: dict, dotted: str):
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _key_error(path: str, number: int, record: dict, key: str, option: str) -> DataError:
    return DataError(
        f"{path}, record {number}: no field {key!r} (fields: {sorted(record)}); set {option}=<one of them>"
    )


def check_files(files: list[str], prompt_key: str, answer_key: str, split: str = "train") -> None:
    """Cheap check before any process starts: every file exists and its first record has the keys."""
    for path in files:
        records = read_records(path, split)
        if not records:
            raise DataError(f"{path} holds no records")
        for key, option in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key:
                try:
                    _field(records[0], key)
                except KeyError:
                    raise _key_error(path, 1, records[0], key, option) from None


def _render(prompt, tokenizer, where: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{where}: the prompt is a list of chat messages but the tokenizer has no chat template; "
                "use a tokenizer with one or give plain-text prompts"
            )
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    raise DataError(f"{where}: a prompt must be a string or a list of {{role, content}} messages, got {prompt!r:.80}")


class PromptDataset:
    """Tokenised prompts; overlong ones dropped (``dropped`` counts them) or refused."""

    def __init__(self, prompts: list[Prompt], dropped: int = 0):
        self.prompts, self.dropped = prompts, dropped

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    @classmethod
    def from_files(cls, files, *, tokenizer, prompt_key, answer_key, max_prompt_length, on_overlong, split="train"):
        prompts, dropped = [], 0
        for path in files:
            for number, record in enumerate(read_records(path, split), 1):
                where = f"{path}, record {number}"
                try:
                    raw = _field(record, prompt_key)
                except KeyError:
                    raise _key_error(path, number, record, prompt_key, "data.prompt_key") from None
                truth = None
                if answer_key:
                    try:
                        truth = _field(record, answer_key)
                    except KeyError:
                        raise _key_error(path, number, record, answer_key, "data.answer_key") from None
                text = _render(raw, tokenizer, where)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(ids) > max_prompt_length:
                    if on_overlong == "error":
                        raise DataError(
                            f"{where}: the prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length};"
                            " raise data.max_prompt_length or set data.on_overlong=drop"
                        )
                    dropped += 1
                    continue
                extras = {k: v for k, v in record.items() if k != prompt_key}
                prompts.append(Prompt(len(prompts), ids, text, truth, extras))
        if not prompts:
            raise DataError(f"no usable prompts in {list(files)} (dropped as too long: {dropped})")
        return cls(prompts, dropped)


class PromptSampler:
    """An endless stream over epochs; epoch ``e`` is the permutation seeded by ``seed + e`` (in order when not
    shuffling). Its position is a plain dict, so a restored sampler continues exactly."""

    def __init__(self, dataset: PromptDataset, seed: int, shuffle: bool = True):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def take(self, k: int) -> list[Prompt]:
        out = []
        while len(out) < k:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.dataset[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self.position = int(d["epoch"]), int(d["position"])
        self._order = self._permutation(self.epoch)
