"""Read a W&B offline run file (`wandb/offline-run-*/run-*.wandb`) back with wandb's own record schema.

wandb.Api reads runs from a W&B server only, and this machine reaches none; the offline file is what `wandb sync`
uploads: a LevelDB-style log (32 KiB blocks, each record a 7-byte header: CRC32, length, type) after a 7-byte
`:W&B` header, each record a `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """The file's records, in order (wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, buf = [], HEADER, b""
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + HEADER])
        pos += HEADER
        if kind == 0 and length == 0:
            break
        buf += raw[pos:pos + length]
        pos += length
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Each `run.log` row: {metric: value, "_step": step, ...}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's config, as the last update of each key left it."""
    out: dict[str, Any] = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        updates = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_file(run_dir: Path) -> Path:
    """The one offline run file under `run_dir`/wandb."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]
