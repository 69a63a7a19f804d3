"""What an offline W&B run folder would upload: the records of its ``run-<id>.wandb`` transaction log.

W&B writes the log in LevelDB's log format (https://github.com/google/leveldb/blob/main/doc/log_format.md) after a
7-byte header (``:W&B``, magic 0xBEE1, version 0); each record is one of W&B's own protocol buffers,
``wandb.proto.wandb_internal_pb2.Record``, which ``wandb sync`` sends as it is. wandb 0.31 ships no Python reader
of the file (the writer is its Go core), so the framing is read here and the records by W&B's protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import wandb
from wandb.proto import wandb_internal_pb2

HEADER = struct.Struct("<4sHB")  # ident, magic, version
RECORD = struct.Struct("<IHB")  # crc32c, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def written() -> None:
    """Wait until W&B has written every record it was given. ``run.finish()`` returns when W&B's service process has
    the records, not when its writer has flushed them to the file; ``wandb.teardown()`` returns when that process has
    exited. A later run starts a new one."""
    wandb.teardown()


def records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order, once every writer has finished."""
    written()
    data = path.read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B transaction log"
    out, pending, pos = [], b"", HEADER.size
    while pos + RECORD.size <= len(data):
        if BLOCK - pos % BLOCK < RECORD.size:  # a block's trailer: too short for a record header
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        chunk = data[pos + RECORD.size: pos + RECORD.size + length]
        pos += RECORD.size + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows: each history record's values, with ``_step`` W&B's step of the row."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            rows.append(row)
    return rows


def of_type(path: Path, kind: str) -> list[Any]:
    """The records of one type (``run``, ``exit``, ``preempting``, ...), as W&B's messages."""
    return [getattr(r, kind) for r in records(path) if r.WhichOneof("record_type") == kind]
