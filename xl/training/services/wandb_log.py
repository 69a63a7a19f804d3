"""What an offline W&B session holds: the records of its ``run-<id>.wandb`` transaction log, which ``wandb sync``
uploads as they are.

W&B writes the log in LevelDB's log format (https://github.com/google/leveldb/blob/main/doc/log_format.md) after a
7-byte header (``:W&B``, magic 0xBEE1, version 0); each record is one of W&B's protocol buffers,
``wandb.proto.wandb_internal_pb2.Record``. wandb 0.31 ships no Python reader of the file (its writer is the Go core),
so the framing is read here and the records by W&B's protobuf. A killed session's log may end in a partial record:
the records before it are read.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")  # ident, magic, version
RECORD = struct.Struct("<IHB")  # crc32c, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def sessions(folder: Path, run_id: str) -> list[Path]:
    """The offline sessions of W&B run ``run_id`` in ``folder`` (``offline-run-<start>-<id>``: the first and each
    resume; ``-<id>-1``, ``-2``, ... for sessions that started within the same second), oldest first."""
    name = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    return sorted(path for path in Path(folder).glob(f"offline-run-*-{run_id}*") if name.fullmatch(path.name))


def records(path: Path) -> list[Any]:
    """Every complete record of a ``.wandb`` file, in order."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path} is not a W&B transaction log")
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
        if len(chunk) < length:  # cut off by a kill
            break
        pos += RECORD.size + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except DecodeError:
                break
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows: each history record's values, with ``_step`` W&B's step of the row."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def logged_at(folders: list[Path], step: int) -> set[str]:
    """The keys that the sessions ``folders`` hold in their rows of ``step``."""
    return {key for folder in folders for log in folder.glob("run-*.wandb") for row in history(log)
            if row.get("_step") == step for key in row}
