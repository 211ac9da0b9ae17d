"""Read back what the wandb and TensorBoard sinks wrote, with those packages' own formats.

wandb 0.31 has no Python reader of its run files (its Go core writes them), so ``wandb_history``
parses the file's framing itself: the records are wandb's ``Record`` protobufs in LevelDB's log
framing (a 7-byte ``:W&B`` header, 32 KiB blocks, each chunk ``crc32 | length | type``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # the rest of a block too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero-filled tail of a block
            pos += _BLOCK - pos % _BLOCK
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_file: Path) -> dict[tuple[str, int], float]:
    """(metric, step) -> value of every ``wandb.log`` in an offline run file (``run-*.wandb``)."""
    logged = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                logged[(key, record.history.step.num)] = json.loads(item.value_json)
    return logged


def wandb_config(run_file: Path) -> dict:
    """The config of the last ``config`` record of a run file (keys to their JSON values)."""
    config = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
    return config


def tensorboard_scalars(log_dir: Path) -> dict[tuple[str, int], float]:
    """(tag, step) -> value of every scalar in the event files of ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
