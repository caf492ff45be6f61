"""Read the history rows of an offline W&B run file (``run-<id>.wandb``), for tests.

The file is a LevelDB-style log (32 KiB blocks of checksummed fragments, after a 7-byte
``:W&B`` header) of ``wandb_internal_pb2.Record`` protobufs; no wandb API reads it offline.
"""

from __future__ import annotations

import json
import struct
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # crc32 (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    out, pending, pos = [], b"", 7  # skip the file header
    while pos + _HEADER <= len(data):
        block_left = _BLOCK - pos % _BLOCK
        if block_left < _HEADER:  # block trailer padding
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
        elif kind == 0 and length == 0:
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
    return out


def history(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(history rows with their ``_step``, config) of one offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    rows, config = [], {}
    for raw in _records(data):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in rec.history.item
            }
            rows.append(row)
        elif kind in ("config", "run"):
            updates = rec.config.update if kind == "config" else rec.run.config.update
            for item in updates:
                config[item.key] = json.loads(item.value_json)
    return rows, config
