"""The wandb and TensorBoard sinks (``trainer.logger`` names ``wandb``, ``tensorboard``).

Both are optional extras (``pip install 'megarl[wandb]'``, ``'megarl[tensorboard]'``); config
validation and the launcher's pre-flight refuse a logger whose package is missing
(``megarl.config.choices.missing_logger_extras``), so nothing here fails mid-run for it. They
receive exactly what the MLflow sink receives: every metric of every step, under the trainer's
own names. Where they differ from verl 0.9.1: the class docstrings.
"""

from __future__ import annotations

import json
import netrc
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlparse

from megarl.tracking.paths import TENSORBOARD_DIR, WANDB_DIR, WANDB_STATE_FILE
from megarl.tracking.sinks import Status, warn


def wandb_has_api_key() -> bool:
    """An API key wandb would use: ``$WANDB_API_KEY`` or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbSink:
    """One wandb run per megarl run, under ``<run dir>/wandb/`` (verl: the working directory).

    Offline without an API key, or when the online start fails (upload later with
    ``wandb sync``); ``$WANDB_MODE``, when set, decides. A resumed launch continues the same
    wandb run (its id is in ``<run dir>/wandb_run.json``; verl starts a new one); wandb ignores
    a step below the last it holds, so steps a launch resumed from an older checkpoint runs
    again keep their first values there (wandb's run rewind needs its server). wandb's console
    capture is off: the run's output is in ``<run dir>/logs/``.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        project_name: str,
        experiment_name: str,
        resumed: bool,
        notify: Callable[[str], None] = warn,
    ) -> None:
        import wandb

        self.run_dir = Path(run_dir)
        state_file = self.run_dir / WANDB_STATE_FILE
        run_id = None
        if resumed and state_file.exists():
            run_id = json.loads(state_file.read_text()).get("id")
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_api_key() else "offline")
        (self.run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        kwargs = {
            "project": project_name,
            "name": experiment_name,
            "dir": str(self.run_dir),
            "id": run_id,
            "resume": "allow" if run_id else None,
            "settings": wandb.Settings(console="off"),
        }
        try:
            self._run = wandb.init(mode=mode, **kwargs)
        except Exception as exc:  # no network, a refused key: keep the metrics offline
            if mode == "offline":
                raise
            notify(f"wandb did not start online ({type(exc).__name__}: {exc}); logging offline")
            mode = "offline"
            self._run = wandb.init(mode=mode, **kwargs)
        self.mode = mode
        state_file.write_text(json.dumps({"id": self._run.id}))
        where = self.run_dir / WANDB_DIR
        note = f"; upload it with `wandb sync {where}/offline-run-*`" if mode == "offline" else ""
        notify(f"wandb run {self._run.id} ({mode}) in {where}{note}")

    def log_config(self, resolved: dict, yaml_text: str) -> None:
        self._run.config.update(resolved, allow_val_change=True)

    def log_metrics(
        self, step: int, metrics: Mapping[str, float], *, timestamp: float | None = None
    ) -> None:
        self._run.log({k: float(v) for k, v in metrics.items()}, step=int(step))

    def finish(self, status: Status) -> None:
        if self._run is not None:
            import wandb

            self._run.finish(exit_code=0 if status == "FINISHED" else 1)
            self._run = None
            # run.finish() returns once wandb's service has the run's last records, not once its
            # run file holds them (seen: a file read right after lacked the last step); its
            # teardown waits for the service to close the file. wandb's own atexit hook does
            # this, but megarl's fast exit skips it.
            wandb.teardown()


class TensorboardSink:
    """Scalars in TensorBoard event files, one tag per metric, at the trainer's step.

    In ``$TENSORBOARD_DIR`` as in verl, else ``<run dir>/tensorboard/`` (verl:
    ``tensorboard_log/<project>/<experiment>`` under the working directory). ``purge_step``
    (a resumed launch: its checkpoint's step + 1): TensorBoard hides what earlier launches
    logged from that step on, the steps this launch runs again (verl passes none).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        notify: Callable[[str], None] = warn,
        purge_step: int | None = None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(os.environ.get("TENSORBOARD_DIR") or Path(run_dir) / TENSORBOARD_DIR)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer: SummaryWriter | None = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        notify(f"TensorBoard event files in {self.log_dir}")

    def log_config(self, resolved: dict, yaml_text: str) -> None:
        """Nothing, as verl: the config snapshot lives in ``config/`` of the run directory."""

    def log_metrics(
        self, step: int, metrics: Mapping[str, float], *, timestamp: float | None = None
    ) -> None:
        if self._writer is None:
            raise RuntimeError(f"{self.log_dir}: metrics logged after finish()")
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), int(step), walltime=timestamp)
        self._writer.flush()

    def finish(self, status: Status) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
