"""Prompt datasets: JSONL / Parquet records (or ``builtin:NAME``), tokenised once, with a seeded epoch stream."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from megarl.data.builtin import PREFIX, builtin_records

FORMATS = (".jsonl", ".json", ".parquet")
_TOKENIZE_CHUNK = 1024  # prompts per tokenizer call (fast tokenizers batch in Rust)


class DataError(ValueError):
    """Data that cannot be used; the message names the file / record / key and the fix."""


@dataclass
class Prompt:
    """One prompt as the engine sees it."""

    index: int
    """Position in the dataset (after overlong prompts were dropped)."""
    prompt_ids: list[int]
    """Token ids of ``prompt_text`` (no special tokens added)."""
    prompt_text: str
    """The text given to the tokenizer (after the chat template, if any)."""
    ground_truth: object = None
    """The answer-key field (None when data.answer_key is empty)."""
    extras: dict = field(default_factory=dict)
    """The record's other fields (every field but the prompt), passed to the reward function."""
    source: object = None
    """The prompt field as the record held it (a string or chat messages): what an environment's reset reads."""


# ---- reading records -------------------------------------------------------------------------------------------


def _missing(path: str) -> DataError:
    return DataError(
        f"data file not found: {path}; set data.train_files / data.val_files to existing JSONL or Parquet files"
    )


def _unsupported(path: str) -> DataError:
    return DataError(f"{path}: unsupported format; use one of {FORMATS} (or builtin:NAME)")


def _json_record(path: str, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{number}: not a JSON object ({e.msg}); write one JSON object per line") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: a {type(record).__name__}, not a JSON object; one object per line")
    return record


def _json_rows(path: str, limit: int | None = None):
    """(where, record) of a JSONL file, streamed (blank lines skipped; ``where`` is 'path:LINE'); a ``.json`` file
    holding one JSON array is read whole ('path, element N')."""
    with open(path, encoding="utf-8-sig") as f:  # -sig: a leading BOM is not data
        if path.endswith(".json") and f.read(64).lstrip().startswith("["):
            f.seek(0)
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: invalid JSON array ({e.msg})") from None
            for number, row in enumerate(rows, 1):
                if not isinstance(row, dict):
                    raise DataError(f"{path}: element {number} is a {type(row).__name__}, not a JSON object")
            yield from ((f"{path}, element {i}", row) for i, row in enumerate(rows[:limit], 1))
            return
        f.seek(0)
        count = 0
        for number, line in enumerate(f, 1):
            if limit is not None and count >= limit:
                return
            if line.strip():
                count += 1
                yield f"{path}:{number}", _json_record(path, number, line)


def _parquet_rows(path: str, limit: int | None = None):
    """(where, record) of a Parquet file, streamed by record batch ('path, row N')."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        number = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=min(limit or 65536, 65536)):
            for row in batch.to_pylist():
                if limit is not None and number >= limit:
                    return
                number += 1
                yield f"{path}, row {number}", row
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _rows(path: str, split: str, limit: int | None):
    """(where, record) of one data file, streamed; DataError naming the file (and line) when it cannot be read."""
    if path.startswith(PREFIX):
        try:
            records = builtin_records(path, split)[:limit]
        except KeyError:
            raise DataError(f"{path}: no split {split!r} (built-in datasets have 'train' and 'val')") from None
        except ValueError as e:
            raise DataError(str(e)) from None
        yield from ((f"{path}, record {i}", r) for i, r in enumerate(records, 1))
        return
    if not path.endswith(FORMATS):
        raise _unsupported(path)
    if not os.path.isfile(path):
        raise _missing(path)
    yield from (_parquet_rows if path.endswith(".parquet") else _json_rows)(path, limit)


def _read(path: str, split: str, limit: int | None) -> list[dict]:
    return [record for _, record in _rows(path, split, limit)]


def count_records(path: str, split: str = "train") -> int:
    """How many records a data file holds, without parsing them where the format allows (JSONL: its non-blank
    lines; Parquet: its metadata)."""
    if path.endswith(".parquet") and os.path.isfile(path):
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.endswith(".jsonl") and os.path.isfile(path):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    return sum(1 for _ in _rows(path, split, None))


def read_records(path: str, split: str = "train") -> list[dict]:
    """The records of one data file: JSONL ('.jsonl' / '.json', one object per line; a '.json' file may instead hold
    one array of objects), Parquet, or 'builtin:NAME' (``split``: 'train' or 'val')."""
    return _read(path, split, None)


# ---- fields ------------------------------------------------------------------------------------------------------


def _field(record: dict, dotted: str):
    """``record['a']['b']`` for 'a.b'; KeyError(keys where the path stopped) if absent."""
    value = record
    for depth, part in enumerate(dotted.split(".")):
        if not isinstance(value, dict) or part not in value:
            where = ".".join(dotted.split(".")[:depth])
            keys = sorted(value) if isinstance(value, dict) else f"a {type(value).__name__}, not a mapping"
            raise KeyError(f"fields of {where}: {keys}" if where else f"fields: {keys}")
        value = value[part]
    return value


def _get(record: dict, key: str, option: str, where: str):
    try:
        return _field(record, key)
    except KeyError as e:
        raise DataError(f"{where}: no field {key!r} ({e.args[0]}); set {option}=<one of them>") from None


def _check_prompt(prompt, where: str) -> None:
    messages = isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)
    if isinstance(prompt, str) or (messages and all("role" in m and "content" in m for m in prompt)):
        return
    raise DataError(
        f"{where}: a prompt must be a string or a non-empty list of {{'role', 'content'}} messages, got "
        f"{prompt!r:.100}; point data.prompt_key at such a field"
    )


CHECK_HELP = "'full' (every record), 'first:N' (the first N records of each file) or 'off' (only that they exist)"


def parse_check(check: str) -> int | None:
    """``data.check`` as a per-file record limit (None: every record; 0: none); ValueError naming the choices."""
    if check == "full":
        return None
    if check == "off":
        return 0
    head, _, n = check.partition(":")
    if head == "first" and n.isdigit() and int(n) >= 1:
        return int(n)
    raise ValueError(f"must be {CHECK_HELP}, got {check!r}")


def check_files(
    files: list[str], prompt_key: str, answer_key: str, split: str = "train", check: str = "full"
) -> int | None:
    """Before any process starts (no tokenizer): every file exists in a supported format, and its records (all of
    them, or the first N: ``data.check``) are JSON objects with the prompt (a string or chat messages) and the answer
    key; DataError names the file and line. Returns how many records the files hold (None with check='off')."""
    limit = parse_check(check)
    total = 0
    for path in files:
        if limit == 0:
            if not path.startswith(PREFIX) and not os.path.isfile(path):
                raise _missing(path)
            continue
        checked = 0
        for where, record in _rows(path, split, limit):
            _check_prompt(_get(record, prompt_key, "data.prompt_key", where), where)
            if answer_key:
                _get(record, answer_key, "data.answer_key", where)
            checked += 1
        if not checked:
            raise DataError(f"{path} holds no records; give a file with at least one")
        total += checked if limit is None else count_records(path, split)
    return None if limit == 0 else total


# ---- tokenising ------------------------------------------------------------------------------------------------


def _render(prompt, tokenizer, where: str) -> str:
    _check_prompt(prompt, where)
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: the prompt is a list of chat messages but the tokenizer has no chat template; use a model "
            "whose tokenizer has one (e.g. an -Instruct model) or give plain-text prompts"
        )
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def _prompts_of(records, source, *, tokenizer, prompt_key, answer_key, max_prompt_length, on_overlong):
    """(prompts numbered from 0, number dropped as overlong) of the records of one source (a file name)."""
    if on_overlong not in ("drop", "error"):
        raise ValueError(f"on_overlong must be 'drop' or 'error', got {on_overlong!r}")
    rows = []  # (record number, text, ground truth, extras, the prompt field)
    for number, record in enumerate(records, 1):
        where = f"{source}, record {number}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: a {type(record).__name__}, not a mapping of fields")
        raw = _get(record, prompt_key, "data.prompt_key", where)
        text = _render(raw, tokenizer, where)
        truth = _get(record, answer_key, "data.answer_key", where) if answer_key else None
        rows.append((number, text, truth, {k: v for k, v in record.items() if k != prompt_key}, raw))
    prompts, dropped = [], 0
    for start in range(0, len(rows), _TOKENIZE_CHUNK):
        chunk = rows[start : start + _TOKENIZE_CHUNK]
        ids_per_row = tokenizer([row[1] for row in chunk], add_special_tokens=False)["input_ids"]
        for (number, text, truth, extras, raw), ids in zip(chunk, ids_per_row):
            if len(ids) > max_prompt_length:
                if on_overlong == "error":
                    raise DataError(
                        f"{source}, record {number}: the prompt has {len(ids)} tokens > "
                        f"data.max_prompt_length={max_prompt_length}; raise data.max_prompt_length or set "
                        "data.on_overlong=drop"
                    )
                dropped += 1
                continue
            prompts.append(Prompt(len(prompts), list(ids), text, truth, extras, raw))
    return prompts, dropped


class PromptDataset:
    """Tokenised prompts; overlong ones dropped (``dropped`` counts them, for the caller to log) or refused."""

    def __init__(self, prompts: list[Prompt], dropped: int = 0):
        self.prompts, self.dropped = prompts, dropped

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    @classmethod
    def from_records(cls, records: list[dict], *, source: str = "records", **options) -> PromptDataset:
        """The dataset of in-memory records; ``source`` names them in error messages; ``options`` as
        ``from_sources``."""
        return cls.from_sources([(source, records)], **options)

    @classmethod
    def from_files(cls, files: list[str], *, split: str = "train", **options) -> PromptDataset:
        """The dataset of JSONL / Parquet files or 'builtin:NAME' (see ``read_records``), in file order; ``options``
        as ``from_sources``."""
        return cls.from_sources([(path, read_records(path, split)) for path in files], **options)

    @classmethod
    def from_sources(
        cls,
        sources: list[tuple[str, list[dict]]],
        *,
        tokenizer,
        prompt_key: str,
        answer_key: str,
        max_prompt_length: int,
        on_overlong: str,
    ) -> PromptDataset:
        """(name, records) pairs concatenated, the name used in error messages; DataError if no prompt is left."""
        prompts, dropped = [], 0
        for source, records in sources:
            part, part_dropped = _prompts_of(
                records,
                source,
                tokenizer=tokenizer,
                prompt_key=prompt_key,
                answer_key=answer_key,
                max_prompt_length=max_prompt_length,
                on_overlong=on_overlong,
            )
            for p in part:
                p.index = len(prompts)
                prompts.append(p)
            dropped += part_dropped
        if not prompts:
            names = [source for source, _ in sources]
            raise DataError(
                f"no usable prompts in {names} ({dropped} dropped as longer than "
                f"data.max_prompt_length={max_prompt_length}); give non-empty data or raise the limit"
            )
        return cls(prompts, dropped)


# ---- sampling ----------------------------------------------------------------------------------------------------


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of ``epoch`` of a run seeded ``seed``: a hash of the pair (torch's CPU generator keeps 32 bits
    of a seed), so epoch e of seed s does not shuffle like epoch 0 of seed s + e."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{epoch}".encode()).digest()[:4], "little")


class PromptSampler:
    """An endless stream over epochs; epoch ``e`` is the permutation seeded by ``epoch_seed(seed, e)`` (in order
    when not shuffling). Its position is a plain dict, so a restored sampler continues exactly."""

    def __init__(self, dataset: PromptDataset, seed: int, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("PromptSampler needs a non-empty dataset")
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """Epochs completed before the next prompt (0 in the first pass)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Prompts of the current epoch already taken."""
        return self._position

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        import torch  # here: the recipe's checks read the data through this module before torch loads

        return torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(self.seed, epoch))).tolist()

    def take(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts, crossing into the next epoch(s) when this one runs out."""
        out = []
        while len(out) < k:
            if self._position == len(self._order):
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
            stop = min(len(self._order), self._position + k - len(out))
            out.extend(self.dataset[i] for i in self._order[self._position : stop])
            self._position = stop
        return out

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, d: dict) -> None:
        epoch, position = int(d["epoch"]), int(d["position"])
        if epoch < 0 or not 0 <= position <= len(self.dataset):
            raise ValueError(
                f"sampler state {d} does not fit a dataset of {len(self.dataset)} prompts; resume with the same data"
            )
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)
