"""Read a W&B offline run file (``run-*.wandb``) back: its history rows, parsed with wandb's own protobuf schema.

The file is a 7-byte W&B header followed by LevelDB-log records (32 KiB blocks; 7-byte record headers: crc32c,
length, type FULL/FIRST/MIDDLE/LAST), each a ``wandb_internal_pb2.Record``. wandb 0.31 ships the schema but no
Python reader (its Go core writes the file).
"""

from __future__ import annotations

import json
import struct

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left  # block trailer padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(path: str) -> list[dict]:
    """One dict per logged step: key -> value."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows
