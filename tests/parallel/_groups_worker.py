"""The communicators a trainer step uses against those ``connect_groups`` made at set-up.

For each case of the spec: the trainer's own set-up (``build_run``, which connects the groups),
its first weight sync and one ``train_step``, with every ``torch.distributed`` call logged
from the end of ``connect_groups`` on (:mod:`tests.parallel._collective_log`). Rank 0 writes,
per case and rank, what set-up connected, what the step used and what it used unconnected:
``python -m torch.distributed.run --nproc_per_node 2 _groups_worker.py SPEC.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.parallel._collective_log import CollectiveLog

LOG = CollectiveLog()
LOG.install()  # before Megatron keeps references to the collectives


class _Sink:
    """Takes the weights as a vLLM TP rank would (the executor's sends are what is checked)."""

    def begin_weight_update(self) -> None:
        self.tensors = 0

    def load_weight_chunk(self, named_tensors) -> None:
        self.tensors += len(list(named_tensors))

    def finish_weight_update(self) -> None:
        assert self.tensors > 0


def _label(group, pair, connected) -> str:
    name = next((c.name for c in connected if c.group is group), None)
    if name is None:
        name = (
            f"ranks {[dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]}"
        )
    return f"{name} {pair[0]}<->{pair[1]}" if pair else name


def _case(spec: dict, case: dict) -> dict:
    from megarl.config import load_config
    from megarl.parallel import init
    from megarl.trainer.console import Console
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step

    made: list = []
    original = init.connect_groups

    sync_tp = case.get("sync_rollout_tp")  # the actor engine has no plan: the case's sync's

    def connect_and_record(rollout_tp=None):
        LOG.recording, LOG.used = False, []
        made[:] = original(rollout_tp if sync_tp is None else sync_tp)
        LOG.recording = True
        return made

    init.connect_groups = connect_and_record
    run_dir = Path(spec["tmp"]) / case["name"]
    cfg = load_config([case["config"]], [*spec["overrides"], *case["overrides"],
                                         f"trainer.default_local_dir={run_dir}"])  # fmt: skip
    try:
        with Console(run_dir / "logs", rank=int(os.environ["RANK"])) as console:
            run = build_run(cfg, console, run_dir)
            try:
                first_sync(run)
                prompts = [run.train_data[i] for i in next(run.sampler)]
                train_step(run, 1, prompts)
                if sync_tp is not None:  # the reshard executor, as for vLLM at this TP
                    from megarl.rollout.reshard import plan_for_chunks, sync_weights

                    chunks = run.actor.chunks
                    plan = plan_for_chunks(chunks, run.actor.model.dims, sync_tp)
                    sync_weights(chunks, plan, _Sink())
            finally:
                run.rewards.close()
    finally:
        LOG.recording = False
        init.connect_groups = original
    connected = {(id(c.group), c.pair) for c in made}
    return {
        "connected": [_label(c.group, c.pair, made) for c in made],
        "used": [_label(g, p, made) for g, p in LOG.used],
        "unconnected": [_label(g, p, made) for g, p in LOG.used if (id(g), p) not in connected],
        "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for case in spec["cases"]:
        mine = _case(spec, case)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=dist.new_group(backend="gloo"))
        results[case["name"]] = every
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
