"""Reading an offline wandb run back, so that tests can check what training logged to wandb.

wandb >= 0.19 dropped its Python reader (the Go core writes the file); the ``.wandb`` transaction log is LevelDB's
log format: 32 KiB blocks of checksummed chunks after a 7-byte file header, a record split over FIRST/MIDDLE/LAST
chunks, each record a protobuf ``Record`` of wandb's own schema.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

_WANDB_IDENT = b":W&B"
_BLOCK = 32768
_HEADER = 7  # checksum u32, length u16, record type u8 (LevelDB log format, which wandb's .wandb files use)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` transaction log, decoded with wandb's own ``Record`` message.

    wandb >= 0.19 dropped its Python reader (the Go core writes the file); the format is LevelDB's log: 32 KiB
    blocks of checksummed chunks after a 7-byte file header, a record split over FIRST/MIDDLE/LAST chunks.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    if ident != _WANDB_IDENT or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a wandb transaction log (header {data[:_HEADER]!r})")
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block tail too short for a chunk header is zero padding
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            raise ValueError(f"{path}: corrupt chunk at byte {pos}")
        pos += _HEADER + length
        pending += chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_records(path: Path, timeout: float = 60.0) -> list[Any]:
    """The records of a run's log once wandb has written all of it, up to its ``exit`` record.

    ``run.finish()`` returns before wandb's core process has flushed the offline file: read at once, the file held
    none of the last rows in 2 of 8 tries here (all of them 3 s later). So the reader waits for the record that
    closes a run, and a run that never gets one within ``timeout`` is an error, not an empty history."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = read_wandb_records(path)
        except ValueError:  # a chunk still being written at the tail
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no exit record after {timeout:.0f} s; wandb did not finish writing the run")
        time.sleep(0.1)


def read_wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows (``run.log`` calls) of every offline wandb run under ``run_dir`` (oldest first), each run
    read once wandb has finished writing it."""
    rows = []
    for path in sorted(Path(run_dir).glob("**/offline-run-*/run-*.wandb")):
        for record in finished_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows
