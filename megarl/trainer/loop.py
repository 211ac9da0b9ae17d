"""A rank's whole run: :func:`run` builds, resumes, validates, steps, logs and saves, with a quiet
console (megarl's own lines; third-party output goes to the rank's log file).

A failure is one ``error:`` line: exit 2 for an input error (a bad file, value, checkpoint or
reward function), 1 otherwise.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.checkpoint.layout import CheckpointError
from megarl.checkpoint.processes import stop_writer_processes
from megarl.checkpoint.resume import choose_checkpoint
from megarl.checkpoint.stop import StopRequest
from megarl.config import MegarlConfig, to_dict, to_yaml
from megarl.trainer.console import Console

if TYPE_CHECKING:
    from megarl.trainer.setup import Run

# Megatron, vLLM and transformers are imported inside run(), after the console is redirected:
# some of them print warnings when imported.


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite updates): one line."""


def run(cfg: MegarlConfig, *, verbose: bool | None = None) -> int:
    """Train with the resolved config ``cfg`` on this rank; returns the exit status (0 finished or
    stopped on request, 2 an input error, 1 a failure; time-stamped on the console then)."""
    started = time.time()
    if verbose is None:
        verbose = os.environ.get("MEGARL_VERBOSE", "0") not in ("", "0")
    run_dir = Path(cfg.trainer.default_local_dir).expanduser().resolve()
    from megarl.config.batch_plan import rollout_ranks, teacher_blocks, teacher_ranks, world_size

    if rollout_ranks(cfg) or teacher_ranks(cfg):  # vLLM on ranks of its own: split the launch
        from megarl.parallel.init import process_group_timeout_minutes
        from megarl.rollout.remote.split_world import split_world

        minutes = process_group_timeout_minutes(cfg.actor_rollout_ref.nccl_timeout)
        role = split_world(world_size(cfg), teacher_size=teacher_ranks(cfg),
                           teacher_sizes=teacher_blocks(cfg),
                           timeout=timedelta(minutes=minutes)).role  # fmt: skip
        if role != "train":
            return _serve_rollout(cfg, run_dir, verbose)
    rank = int(os.environ.get("RANK", "0"))
    run: Run | None = None
    tracker = None
    stop = StopRequest(run_dir, rank).install()  # SIGTERM/SIGUSR1/STOP file: save, exit 0
    with Console(run_dir / "logs", rank=rank, verbose=verbose) as console:
        try:
            from megarl.tracking import make_tracker
            from megarl.trainer.setup import build_run
            from megarl.trainer.step import first_sync, validate

            run = build_run(cfg, console, run_dir)
            resumed = _resume(run)
            first_sync(run)
            tracker = make_tracker(
                cfg,
                rank=run.rank,
                world_size=run.world_size,
                console_write=console.print,
                resume_run_id=run.state.tracking_run_id,
                resumed=resumed,
                resume_step=run.state.step,
            )
            tracker.log_config(to_dict(cfg), to_yaml(cfg))
            _announce(run)
            first_val = last_val = None
            if run.val_data is not None and cfg.trainer.val_before_train:
                metrics = validate(run, run.state.step)
                first_val = last_val = metrics["val/score/mean"]
                tracker.log_metrics(run.state.step, metrics)
            last_val, stopped = _train_steps(run, tracker, last_val, stop)
            if run.ahead is not None:
                run.ahead.shutdown()  # vLLM on ranks of its own: they stop serving
            if run.teacher_client is not None:
                run.teacher_client.shutdown()  # the teacher's vLLM on ranks of its own too
            tracker.finish("KILLED" if stopped else "FINISHED")
            if not stopped:  # a stop has said its one line ("stopped after step N ...")
                _farewell(run, first_val, last_val)
            return 0
        except BaseException as exc:
            if tracker is not None:
                tracker.fail(exc)
            if isinstance(exc, KeyboardInterrupt):
                raise
            console.error(f"error: {_one_line(exc)} (details: {console.log_path})")
            # An input error (a bad file, value or checkpoint) exits 2, as the launcher's
            # pre-flight does; the launcher reads that from torchrun's report.
            from megarl.reward.manager import RewardError  # the user's scorer failed

            input_error = isinstance(
                exc, ValueError | FileNotFoundError | CheckpointError | RewardError
            )
            if verbose or not (input_error or isinstance(exc, TrainingError)):
                import traceback

                traceback.print_exc()  # into the log file unless verbose
            if os.environ.get("RANK", "0") == "0":
                print(f"megarl: failed after {time.time() - started:.0f} s", file=sys.stderr)
            return 2 if input_error else 1
        finally:
            stop.restore()
            stop_writer_processes()
            if run is not None:
                run.rewards.close()


def _serve_rollout(cfg: MegarlConfig, run_dir: Path, verbose: bool) -> int:
    """A rollout-only (or teacher-only) rank: serve the training ranks' commands until they stop
    (its console lines and vLLM's logs go to its log file; a signal here writes the STOP file, a
    stop request the training ranks act on, after which they stop this rank)."""
    from megarl.rollout.remote.split_world import current
    from megarl.trainer.setup import serve_rollout, serve_teacher

    rank = int(os.environ["MEGARL_LAUNCH_RANK"])
    stop = StopRequest(run_dir, rank, relay=True).install()  # survive SIGTERM/USR1: pass on
    try:
        with Console(run_dir / "logs", rank=rank, verbose=verbose):
            (serve_teacher if current().role == "teacher" else serve_rollout)(cfg)
        return 0
    finally:
        stop.restore()
        stop.withdraw()  # honoured by now, or the training ranks are gone


def _train_steps(
    run: Run, tracker, last_val: float | None, stop: StopRequest
) -> tuple[float | None, bool]:
    """Train the remaining steps; returns (last validation score, stopped on request)."""
    from tqdm import tqdm

    from megarl.config.async_schedule import ask_limit, asks_ahead, at_frequency
    from megarl.trainer.step import ask_ahead, train_step, validate

    cfg = run.cfg
    bar = tqdm(
        total=run.total_steps,
        initial=run.state.step,
        file=run.console.out,
        disable=run.rank != 0,
        desc="training",
        unit="step",
        dynamic_ncols=True,
    )
    # Closed on the way out whatever the way (an error too): its line is ended before the
    # error's, which would otherwise be printed on the bar's line.
    try:
        limit = cfg.trainer.max_consecutive_skipped_steps
        # vLLM on ranks of its own: each step asks for the batches of the later steps that
        # async_training's staleness bound allows (megarl.config.async_schedule.ask_limit; s
        # steps off: the s steps after it) as soon as its own is in. The sampler is drawn ahead, but the state
        # saved is the one after the last batch this step consumed: a resumed run generates the
        # batches asked ahead again rather than skip them. Dynamic sampling takes its extra
        # generation batches from the same queue (more()), so batches asked ahead are numbered
        # in the order drawn (the number is the request's, for its seeds and its dump file);
        # without it, the number of a step's batch is the step.
        ahead = run.ahead is not None and asks_ahead(cfg)
        queued: deque[tuple[list, dict, int]] = deque()  # (prompts, sampler state after, number)
        numbers = itertools.count(run.state.step + 1)

        def draw() -> tuple[list, dict]:
            prompts = [run.train_data[i] for i in next(run.sampler)]
            return prompts, run.sampler.state_dict()

        drawn: dict = {}

        def refill(step: int) -> list[tuple[int, list]]:  # (number, prompts) to ask for now
            asks = []
            limit = min(ask_limit(cfg, step), run.total_steps) if ahead else step
            while step + len(queued) < limit:
                queued.append((*draw(), next(numbers)))
                asks.append((queued[-1][2], queued[-1][0]))
            return asks

        def more() -> tuple[list, int | None]:
            """Dynamic sampling's next generation batch, and its number when it was asked
            ahead; the state saved is the sampler's after it."""
            if not queued:
                prompts, drawn["state"] = draw()
                return prompts, None
            prompts, drawn["state"], number = queued.popleft()
            for later, later_prompts in refill(drawn["step"]):
                ask_ahead(run, later_prompts, later)
            return prompts, number

        for step in range(run.state.step + 1, run.total_steps + 1):
            if queued:
                prompts, sampler_state, number = queued.popleft()
            else:  # colocated, the first step of a launch, or none asked (the last steps)
                prompts, sampler_state = draw()
                number = next(numbers) if ahead else step
            asks = refill(step)
            drawn["state"], drawn["step"] = sampler_state, step
            metrics, _ = train_step(run, step, prompts, asks, more=more, label=number)
            run.state.step = step
            run.state.sampler = drawn["state"]  # after the last generation batch it drew
            run.state.save_kl_coef(run.kl_ctrl)
            skipped = metrics.get("actor/skipped_steps", 0.0)
            run.state.consecutive_skips = run.state.consecutive_skips + 1 if skipped else 0
            metrics["actor/consecutive_skipped_steps"] = float(run.state.consecutive_skips)
            # test_freq and save_freq count weight syncs (every K steps with async_training.
            # trigger_parameter_sync_step = K, as verl's fully-async trainer counts them)
            test_freq = cfg.trainer.test_freq
            if (
                run.val_data is not None
                and test_freq > 0
                and (at_frequency(cfg, step, test_freq) or step == run.total_steps)
            ):
                metrics.update(validate(run, step))
                last_val = metrics["val/score/mean"]
            tracker.log_metrics(step, metrics)
            bar.update(1)
            if limit > 0 and run.state.consecutive_skips >= limit:
                raise TrainingError(
                    f"{run.state.consecutive_skips} consecutive steps had a non-finite gradient and "
                    f"were skipped (trainer.max_consecutive_skipped_steps={limit})"
                )
            stopping = stop.agreed()  # collective, once per step
            save_freq = cfg.trainer.save_freq
            if stopping or (save_freq > 0 and (at_frequency(cfg, step, save_freq)
                                               or step == run.total_steps)):  # fmt: skip
                _save(run, step, tracker)
            if stopping:
                bar.close()  # before the stop line
                why = stop.reason or "a request on another rank"
                run.console.print(f"megarl: stopped after step {step} ({why}); resume to continue")
                if run.rank == 0:
                    stop.consume_stop_file()
                return last_val, True
        return last_val, False
    finally:
        bar.close()


# -- checkpoints: resume before the loop, save after a step ---------------------


def _saved_models(run: Run) -> list:
    """The run's trained models as the checkpoint code sees them: the actor, and the critic when
    the run has one (`critic_enabled`: PPO with GAE, or `critic.enable`)."""
    from megarl.checkpoint.trainer_ckpt import SavedModel

    arr = run.cfg.actor_rollout_ref
    roles = [("actor", run.actor, arr.actor, "actor_rollout_ref.actor", "actor_rollout_ref.model")]
    critic = getattr(run, "critic", None)  # a TrainableModel when the run trains a critic
    if critic is not None:
        roles.append(("critic", critic, run.cfg.critic, "critic", "critic.model"))
    saved = []
    for role, model, section, prefix, model_key in roles:
        path = (run.cfg.critic.model.path if role == "critic" else None) or arr.model.path
        contents = section.checkpoint
        saved.append(
            SavedModel(
                role=role,
                model=model,
                prefix=prefix,
                model_key=f"{model_key}.path",
                model_path=str(path),
                save_contents=tuple(contents.save_contents),
                load_contents=tuple(contents.load_contents or contents.save_contents),
                use_checkpoint_schedule=section.optim.use_checkpoint_opt_param_scheduler,
            )
        )
    return saved


def _warn(run: Run) -> Callable[[str], None]:
    return lambda message: run.console.print(f"megarl: warning: {message}")


def _resume(run: Run) -> bool:
    """Load the checkpoint ``trainer.resume_mode`` picks, if any (the engine syncs next)."""
    from megarl.checkpoint.trainer_ckpt import check_shared_run_dir, load_checkpoint
    from megarl.trainer.residency import enter
    from megarl.trainer.state import TrainerState

    check_shared_run_dir(run.run_dir)
    ckpt = choose_checkpoint(run.cfg.trainer, run.run_dir, _warn(run))
    if ckpt is None:
        return False
    enter(run, "checkpoint")
    run.state = TrainerState.from_dict(load_checkpoint(ckpt, _saved_models(run), _warn(run)))
    run.sampler.load_state_dict(run.state.sampler)
    run.state.restore_kl_coef(run.kl_ctrl)
    run.console.print(f"megarl: resumed from {ckpt} (after step {run.state.step})")
    return True


def _save(run: Run, step: int, tracker) -> None:
    from megarl.checkpoint.trainer_ckpt import save_checkpoint
    from megarl.trainer.residency import enter

    enter(run, "checkpoint", step=step)
    t = run.cfg.trainer
    run.state.tracking_run_id = tracker.run_id or run.state.tracking_run_id
    path, seconds = save_checkpoint(
        run.run_dir,
        step,
        _saved_models(run),
        trainer_state=run.state.to_dict(),
        config_yaml=to_yaml(run.cfg),
        keep={"actor": t.max_actor_ckpt_to_keep, "critic": t.max_critic_ckpt_to_keep},
        export_hf_model=step == run.total_steps,
    )
    run.console.print(f"megarl: saved {path} in {seconds:.1f} s")


def _announce(run: Run) -> None:
    cfg = run.cfg
    meg = cfg.actor_rollout_ref.actor.megatron
    run.console.print(
        f"megarl: {cfg.algorithm.adv_estimator} on {cfg.actor_rollout_ref.model.path}, "
        f"{run.world_size} rank(s), TP {meg.tensor_model_parallel_size} × PP "
        f"{meg.pipeline_model_parallel_size}"
        + (f" × CP {meg.context_parallel_size}" if meg.context_parallel_size > 1 else "")
        + f" × DP {run.plan.data_parallel_size}"
        + (", packed" if run.actor.pack else ", right-padded")
        + ", rollout "
        f"{cfg.actor_rollout_ref.rollout.name} TP {_rollout_placement(cfg, run.engine, run.ahead)}"
        + _teacher_placement(run)
        + f"; {run.total_steps} steps of "
        f"{run.plan.responses_per_step} responses; logs in {run.console.log_path.parent}"
    )


def _teacher_placement(run: Run) -> str:
    """``, teacher ...`` for on-policy distillation (where its scores come from), else ``""``."""
    if run.teacher_client is not None:
        from megarl.config.teachers import teachers

        found = teachers(run.cfg)
        if len(found) == 1:
            ranks, tp = found[0].ranks, found[0].tp
            return (
                f", teacher vllm TP {tp} x {ranks // tp} replica(s) on {ranks} rank(s) of its own"
            )
        routed = "; ".join(f"{t.name} (key {t.key}) TP {t.tp} x {t.ranks // t.tp}" for t in found)
        key = run.cfg.distillation.teacher_key
        return f", {len(found)} vllm teachers routed by {key} on ranks of their own: {routed}"
    if run.teacher is None:
        return ""
    own = run.teacher.layout
    return f", teacher megatron TP {own.tp} × PP {own.pp} on the training ranks"


def _rollout_placement(cfg: MegarlConfig, engine, remote) -> str:
    """The rollout TP and, for vLLM on ranks of its own (``remote``, the run's
    :class:`~megarl.rollout.base.AheadEngine`), where, how far behind and how the weights go."""
    from megarl.config.async_schedule import describe_overlap
    from megarl.config.batch_plan import rollout_ranks

    ranks = rollout_ranks(cfg)
    if not ranks:
        return str(getattr(engine, "tensor_parallel_size", "-"))
    off = describe_overlap(cfg)
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    replicas = f" x {ranks // tp} replicas" if ranks > tp else ""
    link = remote.weights_link if remote is not None else None
    return f"{tp}{replicas} on {ranks} rank(s) of its own, {off}" + (
        f", weights over {link}" if link else ""
    )


def _farewell(run: Run, first: float | None, last: float | None) -> None:
    lines = [f"megarl: finished {run.state.step} steps; outputs in {run.run_dir}"]
    if first is not None and last is not None:
        lines.append(f"megarl: validation score {first:.4f} (before training) -> {last:.4f}")
    for line in lines:
        run.console.print(line)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) < 400 else text[:397] + "..."
