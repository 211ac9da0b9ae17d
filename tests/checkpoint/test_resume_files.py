"""The pre-flight's check of the files a resume reads (issue 23): one line naming the file."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megarl.checkpoint.layout import CheckpointError
from megarl.checkpoint.meta import META_FILE
from megarl.checkpoint.resume import check_checkpoint_files


@pytest.fixture
def ckpt(tmp_path):
    step = tmp_path / "global_step_1"
    dcp.save({"w": torch.arange(4096.0)}, storage_writer=dcp.FileSystemWriter(step / "actor"),
             no_dist=True)  # fmt: skip
    (step / "actor" / META_FILE).write_text("{}")
    (step / "trainer_state.json").write_text(json.dumps({"step": 1}))
    return step


def test_a_whole_checkpoint_passes(ckpt):
    check_checkpoint_files(ckpt)


def test_a_truncated_shard_is_named(ckpt):
    shard = next((ckpt / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"shard {shard} is truncated"):
        check_checkpoint_files(ckpt)


def test_a_corrupt_trainer_state_is_named(ckpt):
    (ckpt / "trainer_state.json").write_text('{"step": ')
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        check_checkpoint_files(ckpt)
