"""Convert checkpoints between Hugging Face and Megatron formats, and check that logits agree.

    megarl convert hf-to-megatron --hf-path HF_DIR --out CKPT [--tp N --pp N --vpp N --ep N]
                                  [--etp N] [--dtype auto|fp32|bf16|fp16] [--verify]
                                  [--decoder-{first,last}-pipeline-num-layers N]
                                  [--account-for-{embedding,loss}-in-pipeline-split]
    megarl convert megatron-to-hf --ckpt CKPT --out HF_DIR [--tp N --pp N --vpp N]
                                  [--dtype auto|fp32|bf16|fp16] [--hf-config DIR] [--verify]
    megarl convert verify --ckpt CKPT --hf-path HF_DIR [--tp N --pp N] [--atol X --rtol Y]

The Megatron side is a distributed checkpoint (:mod:`megarl.checkpoint.dist_ckpt`), loadable at
any TP×PP. Outside a torchrun / Slurm world the command checks its inputs and starts TP×PP local
ranks itself (:mod:`megarl.parallel.spawn`). The ranks write into ``OUT.incomplete``, renamed to
``--out`` once complete; a failure or signal stops every process and removes it. Exit status:
0 ok, 1 verification failed, 2 bad arguments or inputs, 3 a bug (traceback), 128+N signal N.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from megarl.checkpoint.hf_export import checkpoint_meta, copy_side_files
from megarl.checkpoint.layout import HF_FILES_DIR
from megarl.commands.convert_inputs import (
    ConvertError,
    check_inputs,
    conversion_layout,
    safetensors_header,
)
from megarl.config.dtypes import DTYPE_NAMES, SAFETENSORS_DTYPE_NAMES
from megarl.parallel.spawn import WorkerError, inside_launched_world, run_local_world

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_CRASH = 3


# Third-party noise on every run (CPU without TE/Apex, deprecations inside Megatron's own calls).
_HARMLESS_WARNINGS = (
    r"(Transformer Engine and Apex are|Apex is) not installed",
    r"full scope is deprecated",
    r"`load_state_dict` is deprecated",
    r"Please use DTensor instead",
)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl convert",
        description="Convert checkpoints between Hugging Face and Megatron dist-checkpoint "
        "formats; verify that logits agree.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    to_mg = commands.add_parser(
        "hf-to-megatron", help="HF safetensors directory -> Megatron distributed checkpoint"
    )
    to_mg.add_argument(
        "--hf-path",
        required=True,
        metavar="DIR",
        help="HF model directory (config.json, *.safetensors)",
    )
    to_mg.set_defaults(hf_config=None)
    _add_conversion_args(
        to_mg,
        out="checkpoint directory to write",
        dtype="stored dtype (default auto: the dtype of the HF tensors)",
        verify="compare logits with the HF model",
    )

    to_hf = commands.add_parser(
        "megatron-to-hf", help="Megatron distributed checkpoint -> HF safetensors directory"
    )
    to_hf.add_argument(
        "--ckpt", required=True, metavar="DIR", help="checkpoint directory (saved at any TP×PP)"
    )
    to_hf.add_argument(
        "--hf-config",
        default=None,
        metavar="DIR",
        help="HF directory giving config.json and tokenizer files, for checkpoints saved "
        "without them (default: the ones stored in the checkpoint)",
    )
    _add_conversion_args(
        to_hf,
        out="HF model directory to write",
        dtype="dtype of the written tensors (default auto: the checkpoint's)",
        verify="compare logits with the written HF model",
    )

    verify = commands.add_parser(
        "verify", help="compare a Megatron checkpoint's logits with an HF model's"
    )
    verify.add_argument(
        "--ckpt", required=True, metavar="DIR", help="Megatron checkpoint directory"
    )
    verify.add_argument(
        "--hf-path", required=True, metavar="DIR", help="HF model directory to compare with"
    )
    verify.add_argument("--hf-config", default=None, help=argparse.SUPPRESS)
    _add_layout_args(verify)
    _add_verify_args(verify)
    return parser


def _add_conversion_args(
    parser: argparse.ArgumentParser, *, out: str, dtype: str, verify: str
) -> None:
    """What both conversions take: --out, the layout, --dtype, --verify, --force."""
    parser.add_argument("--out", required=True, metavar="DIR", help=out)
    _add_layout_args(parser)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_NAMES],
        metavar="{auto,fp32,bf16,fp16}",
        help=dtype,
    )
    parser.add_argument("--verify", action="store_true", help=verify)
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty --out (its old files go once the new output is complete)",
    )
    _add_verify_args(parser)


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default 1)"
    )
    parser.add_argument(
        "--pp", type=int, default=1, metavar="N", help="pipeline-parallel size (default 1)"
    )
    parser.add_argument(
        "--vpp", type=int, default=None, metavar="N", help="virtual pipeline stages per rank"
    )
    parser.add_argument(
        "--ep", type=int, default=1, metavar="N", help="expert-parallel size (MoE; default 1)"
    )
    parser.add_argument(
        "--etp",
        type=int,
        default=None,
        metavar="N",
        help="tensor-parallel size inside each expert (MoE; default --tp)",
    )
    # Megatron's uneven layer split, by Megatron-LM's own flag names.
    for end in ("first", "last"):
        parser.add_argument(
            f"--decoder-{end}-pipeline-num-layers",
            dest=f"num_layers_in_{end}_pipeline_stage",
            type=int,
            default=None,
            metavar="N",
            help=f"layers of the {end} pipeline stage (default: an even split)",
        )
    for part, what in (("embedding", "the embedding"), ("loss", "the output layer and loss")):
        parser.add_argument(
            f"--account-for-{part}-in-pipeline-split",
            dest=f"account_for_{part}_in_pipeline_split",
            action="store_true",
            help=f"count {what} as one layer of the pipeline split",
        )


def _add_verify_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("verification")
    group.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (1e-4)")
    group.add_argument(
        "--rtol", type=float, default=1e-5, help="tolerance relative to max |logit| (1e-5)"
    )
    group.add_argument("--num-sequences", type=int, default=4, help="random sequences (4)")
    group.add_argument("--seq-len", type=int, default=32, help="longest sequence (32 tokens)")
    group.add_argument("--seed", type=int, default=0, help="seed of the random tokens (0)")


def main(argv: list[str] | None = None) -> int:
    """Run ``megarl convert``; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help, or an argparse usage error (already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        check_inputs(args)
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if inside_launched_world():
        return run_rank(args)
    return launch(args)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher (a BaseException, like ``KeyboardInterrupt``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def launch(args: argparse.Namespace) -> int:
    """Run the command in TP×PP local ranks; stop them all and remove the incomplete output on
    a failure, SIGINT or SIGTERM. Returns the exit status."""
    staging = staging_dir(args)
    handlers = _raise_on_signals((signal.SIGINT, signal.SIGTERM))
    try:
        return _run_local_ranks(args, conversion_layout(args).world_size())
    except Interrupted as exc:
        print(f"error: interrupted ({exc}); stopped every rank", file=sys.stderr, flush=True)
        return 128 + exc.signum
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _raise_on_signals(signums: tuple[int, ...]) -> dict[int, object]:
    """Raise :class:`Interrupted` in the main thread at the first of ``signums``; ignore later
    ones, so that the clean-up it starts is not cut short. Returns the previous handlers."""
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    return {signum: signal.signal(signum, handler) for signum in signums}


def staging_dir(args: argparse.Namespace) -> Path | None:
    """Where the ranks write before rank 0 renames it to ``--out`` (None: nothing is written)."""
    if args.command == "verify":
        return None
    out = Path(args.out).absolute()
    return out.with_name(out.name + ".incomplete")


def _promote(staging: Path, out: Path) -> None:
    """Replace ``out`` (empty, or old output under ``--force``) with the complete ``staging``."""
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(staging, out)


_INPUT_ERRORS = ("ConvertError", "CheckpointError", "CheckpointMismatchError")
"""Exception types by which a rank says the input is wrong (exit 2), by name: ranks report their
errors to the launcher as text."""


def rank_main(args: argparse.Namespace) -> int:
    """Body of each local rank started by :func:`launch` (re-imported by name).

    A failure raises: the launcher stops the other ranks before this one and reports it once
    (one line for bad input, the traceback for a bug). A verification mismatch is a result.
    """
    _quiet_third_party()
    return _run_command(args)


def _run_local_ranks(args: argparse.Namespace, world: int) -> int:
    """Run the command in ``world`` local processes; returns the worst exit status."""
    try:
        return max(run_local_world(rank_main, world, (args,)))
    except WorkerError as exc:
        if exc.error_type in _INPUT_ERRORS:
            print(f"error: {exc.detail}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        if exc.traceback:
            print(exc.traceback, file=sys.stderr, end="", flush=True)
        print(f"error: {exc}", file=sys.stderr, flush=True)  # a bug, killed, died in start-up
        return EXIT_CRASH


def run_rank(args: argparse.Namespace) -> int:
    """One rank's share of the command under torchrun / srun (collective: every rank calls it;
    the world's size must be a multiple of TP×PP).

    Returns the exit status: a bad input prints one ``error:`` line, a bug its traceback.
    """
    from megarl.checkpoint.dist_ckpt import CheckpointError

    _quiet_third_party()
    try:
        return _run_command(args)
    except (ConvertError, CheckpointError) as exc:  # the input, found wanting by a rank
        _print_error(exc)
        return EXIT_USAGE  # no teardown: it would break the collectives the peers are in
    except Exception:  # noqa: BLE001 - a bug: show it, with its own exit status
        traceback.print_exc()
        return EXIT_CRASH


def _run_command(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megarl.parallel.init import destroy_distributed, init_distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = conversion_layout(args)
    if world % (args.tp * args.pp) or world % (layout.etp * layout.ep * layout.pp):
        raise ConvertError(
            f"--tp {args.tp} × --pp {args.pp} (and ETP {layout.etp} × --ep {args.ep} × --pp) "
            f"does not divide the world of {world} ranks"
        )
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    init_distributed(layout, seed=args.seed)
    staging = staging_dir(args)
    if staging is not None and _rank() == 0 and staging.exists():
        shutil.rmtree(staging)  # left by a killed run
    dist.barrier()
    code = _COMMANDS[args.command](args)
    dist.barrier()
    if staging is not None and _rank() == 0:
        _promote(staging, Path(args.out))
        _log(f"wrote {args.out}")
    destroy_distributed()
    return code


def _print_error(exc: BaseException) -> None:
    """One ``error:`` line from the failing rank (ranks other than 0 say which they are)."""
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    world = int(os.environ.get("WORLD_SIZE", "1"))
    where = f"rank {_rank()}: " if world > 1 and _rank() != 0 else ""
    print(f"error: {where}{message}", file=sys.stderr, flush=True)


def _quiet_third_party() -> None:
    """Silence known-harmless warnings of third-party code."""
    import warnings

    for pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # What Megatron asks for with TP on GPU (async grad all-reduce ordering); no effect on CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"[megarl convert] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Commands (run on every rank)
# --------------------------------------------------------------------------------------------


def _build_chunks(hf_path: Path | None, cfg: dict, args: argparse.Namespace, dtype_name: str):
    """This rank's model chunks: loaded from ``hf_path``, or uninitialised (``hf_path`` None) for
    a checkpoint load.

    The vocabulary is padded for this TP; a checkpoint saved with another padding still loads
    (Megatron marks the embedding and output layer ``allow_shape_mismatch``).
    """
    import torch

    from megarl.config.model_dims import ModelDims
    from megarl.models.build import build_model

    layout = conversion_layout(args)
    source = hf_path if hf_path is not None else ModelDims.from_hf_config(cfg, tp_size=args.tp)
    built = build_model(source, layout, dtype=getattr(torch, dtype_name), initialize=False)
    if layout.pipeline_split():  # what Megatron built on rank 0 (stage 0)
        from megarl.models.gpt import unwrap

        held = sum(len(unwrap(chunk).decoder.layers) for chunk in built.chunks)
        _log(f"uneven pipeline split: stage 0 holds {held} of {built.dims.num_layers} layers")
    return built.dims, built.chunks


def _attach_saved_adapters(chunks, meta: dict) -> None:
    """A LoRA actor's checkpoint (``meta["lora"]``) holds adapters: attach them before the load
    so that they are read, and the HF export merges them (the trained policy, not the base)."""
    if not meta.get("lora"):
        return
    from megarl.models.lora import LoraSettings, attach_adapters

    settings = meta["lora"]
    for key in ("target_modules", "exclude_modules"):
        settings[key] = tuple(settings[key])
    _log(f"the checkpoint holds LoRA adapters (rank {settings['rank']}): merging them")
    attach_adapters(chunks, LoraSettings(**settings))


def _load_checkpoint_chunks(ckpt: Path, meta: dict, cfg: dict, args, dtype_name: str):
    """(dims, chunks) holding the checkpoint's model. A LoRA actor's checkpoint holds only its
    adapters (``model_holds``): the base comes from the HF checkpoint it was trained on
    (``source``), then the adapters from ``ckpt``."""
    from megarl.checkpoint.dist_ckpt import load_model_checkpoint

    adapters_only = meta.get("model_holds") == "lora_adapters"
    base = Path(meta["source"]).expanduser() if adapters_only else None
    if base is not None and not base.is_dir():
        raise ConvertError(f"{ckpt} holds LoRA adapters only; their base {base} is not there")
    dims, chunks = _build_chunks(base, cfg, args, dtype_name)
    _attach_saved_adapters(chunks, meta)
    load_model_checkpoint(chunks, ckpt, adapters_only=adapters_only)
    return dims, chunks


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    """Load the HF directory into a model at ``--tp/--pp/--vpp`` and save a dist checkpoint."""
    from megarl.checkpoint.dist_ckpt import save_model_checkpoint
    from megarl.config.model_dims import read_hf_config

    t0 = time.perf_counter()
    hf_path = Path(args.hf_path).resolve()
    cfg = read_hf_config(hf_path)
    dtype = DTYPE_NAMES.get(args.dtype) or safetensors_dtype(hf_path)
    _log(f"building {cfg['architectures'][0]} ({dtype}, TP={args.tp} PP={args.pp}) ...")
    _log(f"loading HF weights from {hf_path} ...")
    _, chunks = _build_chunks(hf_path, cfg, args, dtype)
    out = staging_dir(args)
    layout = {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "etp": args.etp}
    layout |= conversion_layout(args).pipeline_split()
    meta = checkpoint_meta(cfg, source=str(hf_path), dtype=dtype, layout=layout)
    _log(f"saving Megatron distributed checkpoint to {args.out} ...")
    save_model_checkpoint(chunks, out, meta=meta)
    # After the save: Megatron takes files already in the directory for an incomplete checkpoint.
    if _rank() == 0:
        copy_side_files(hf_path, out / HF_FILES_DIR)
    _log(f"saved in {time.perf_counter() - t0:.1f} s")
    del chunks
    if args.verify:
        return verify_logits(args, ckpt=out, hf_path=hf_path)
    return EXIT_OK


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    """Load the dist checkpoint at ``--tp/--pp/--vpp`` and write an HF directory (from the
    checkpoint alone: it holds ``megarl_meta.json`` and the HF side files in ``hf_files/``)."""
    from megarl.checkpoint.hf_export import export_hf
    from megarl.checkpoint.meta import read_checkpoint_meta

    t0 = time.perf_counter()
    ckpt = Path(args.ckpt)
    meta = read_checkpoint_meta(ckpt)
    cfg, side_dir = _ckpt_hf_config(ckpt, meta, args.hf_config)
    stored = meta.get("dtype") or _config_dtype(cfg)
    out_dtype = DTYPE_NAMES.get(args.dtype) or stored
    _log(f"loading {ckpt} ({stored}, TP={args.tp} PP={args.pp}) ...")
    dims, chunks = _load_checkpoint_chunks(ckpt, meta, cfg, args, stored)
    _log(f"writing HF safetensors ({out_dtype}) to {args.out} ...")
    out = export_hf(
        chunks,
        staging_dir(args),
        dims,
        hf_config=cfg,
        dtype_name=out_dtype,
        side_dir=side_dir,
        progress=_log,
    )
    _log(f"exported in {time.perf_counter() - t0:.1f} s")
    del chunks
    if args.verify:
        return verify_logits(args, ckpt=ckpt, hf_path=out)
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    """Compare the checkpoint's logits with the HF model's (``megarl convert verify``)."""
    return verify_logits(args, ckpt=Path(args.ckpt), hf_path=Path(args.hf_path))


def _ckpt_hf_config(ckpt: Path, meta: dict, hf_config: str | None) -> tuple[dict, Path | None]:
    """(HF config dict, directory of tokenizer/config files) of a checkpoint."""
    from megarl.config.model_dims import read_hf_config

    if hf_config:
        return read_hf_config(hf_config), Path(hf_config)
    side = ckpt / HF_FILES_DIR
    return meta["hf_config"], side if side.is_dir() else None


def _config_dtype(cfg: dict) -> str:
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return DTYPE_NAMES.get(name, "float32")


def safetensors_dtype(hf_path: str | Path) -> str:
    """dtype of the HF tensors (read from a safetensors header; the embedding's if present)."""
    files = sorted(Path(hf_path).glob("*.safetensors"))
    for f in files:
        header = safetensors_header(f)
        if not header:
            continue
        entry = header.get("model.embed_tokens.weight") or next(iter(header.values()))
        if entry["dtype"] not in SAFETENSORS_DTYPE_NAMES:
            raise ConvertError(f"{f}: unsupported tensor dtype {entry['dtype']}")
        return SAFETENSORS_DTYPE_NAMES[entry["dtype"]]
    raise ConvertError(f"no tensors in {hf_path}/*.safetensors")


def verify_logits(args: argparse.Namespace, *, ckpt: Path, hf_path: Path) -> int:
    """Compare the checkpoint's logits (Megatron, at ``--tp/--pp/--vpp``) with the HF model's
    (:mod:`megarl.models.verify`); prints the outcome on rank 0 and returns the exit status."""
    from megarl.checkpoint.meta import read_checkpoint_meta
    from megarl.models import verify as v

    t0 = time.perf_counter()
    meta = read_checkpoint_meta(ckpt)
    cfg, _ = _ckpt_hf_config(ckpt, meta, args.hf_config)
    common = v.coarser_dtype(meta.get("dtype") or _config_dtype(cfg), safetensors_dtype(hf_path))
    _log(f"verifying {ckpt} against {hf_path} (float32 compute, weights as {common}) ...")
    dims, chunks = _load_checkpoint_chunks(ckpt, meta, cfg, args, "float32")
    v.round_params([p for c in chunks for p in c.parameters()], common)
    seqs = v.verify_inputs(dims.vocab_size, args.num_sequences, args.seq_len, args.seed)
    logits = v.megatron_logits(chunks, seqs, dims.vocab_size)
    del chunks  # before the HF model is loaded beside it
    outcome = v.compare_with_hf(
        logits,
        hf_path,
        seqs,
        vocab_size=dims.vocab_size,
        round_to=common,
        atol=args.atol,
        rtol=args.rtol,
    )
    if _rank() == 0:
        print(outcome.summary(), flush=True)
    _log(f"verification took {time.perf_counter() - t0:.1f} s")
    return EXIT_OK if outcome.ok else EXIT_MISMATCH


_COMMANDS = {
    "hf-to-megatron": run_hf_to_megatron,
    "megatron-to-hf": run_megatron_to_hf,
    "verify": run_verify,
}
