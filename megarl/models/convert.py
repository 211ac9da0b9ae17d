"""Convert checkpoints between Hugging Face and Megatron formats, and check that logits agree.

    megarl convert hf-to-megatron --hf-path HF_DIR --out CKPT [--tp N --pp N --vpp N]
                                  [--dtype auto|fp32|bf16|fp16] [--verify]
    megarl convert megatron-to-hf --ckpt CKPT --out HF_DIR [--tp N --pp N --vpp N]
                                  [--dtype auto|fp32|bf16|fp16] [--hf-config DIR] [--verify]
    megarl convert verify --ckpt CKPT --hf-path HF_DIR [--tp N --pp N] [--atol X --rtol Y]

(also ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``).

The Megatron side is a Megatron-Core distributed checkpoint (:mod:`megarl.checkpoint.dist_ckpt`,
the format used on GPU), so it loads at any TP×PP. Beside the shards it holds
``megarl_meta.json`` (the HF config, source, dtype, saved layout) and
``hf_files/`` (config, tokenizer and generation files), so ``megatron-to-hf`` needs nothing else.

Processes: run the command once. When TP×PP > 1 and the process is not already one rank of a
torchrun / Slurm world, it starts TP×PP local worker processes itself (``spawn``; gloo on CPU,
NCCL on GPU). Under torchrun / srun the existing world is used (its size must be a multiple of
TP×PP). Entry points keep their work under ``if __name__ == "__main__":`` (DESIGN.md: the
checkpoint writer's helper process re-imports the main module).

Verification runs a few seeded random token sequences of different lengths through the
Megatron model (any layout, through Megatron's pipeline schedule) and through the HF model with
``transformers``, both in float32, after rounding both sides' weights to the coarser of the two
stored dtypes (so a bf16 checkpoint is compared exactly, not through bf16 kernels). It prints
``max |Δlogit|`` and fails (exit 1) above ``atol + rtol · max|logit|``. The HF reference is
loaded by one rank (last pipeline stage, TP rank 0) on the CPU in float32: 4 bytes per parameter.

Exit status: 0 ok, 1 verification failed, 2 bad arguments or inputs (one ``error: ...`` line),
3 an unexpected exception (a bug: traceback shown).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_CRASH = 3

HF_FILES_DIR = "hf_files"
"""Sub-directory of a converted checkpoint holding the source's config and tokenizer files."""
META_FORMAT = "megarl-gpt/1"
_META_FILE = "megarl_meta.json"
"""= ``megarl.checkpoint.dist_ckpt.META_FILE`` (not imported here: it pulls in Megatron)."""

_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".safetensors.index.json",
    ".bin.index.json",
)


# Third-party noise on every run (CPU without TE/Apex, deprecations inside Megatron's own calls).
_HARMLESS_WARNINGS = (
    r"(Transformer Engine and Apex are|Apex is) not installed",
    r"full scope is deprecated",
    r"`load_state_dict` is deprecated",
    r"Please use DTensor instead",
)


class ConvertError(Exception):
    """A problem with the user's inputs, reported as one ``error: ...`` line (exit 2)."""


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
    to_mg.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    _add_layout_args(to_mg)
    to_mg.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *_DTYPES],
        metavar="{auto,fp32,bf16,fp16}",
        help="stored dtype (default auto: the dtype of the HF tensors)",
    )
    to_mg.add_argument("--verify", action="store_true", help="compare logits with the HF model")
    to_mg.add_argument("--force", action="store_true", help="write into a non-empty --out")
    to_mg.set_defaults(hf_config=None)
    _add_verify_args(to_mg)

    to_hf = commands.add_parser(
        "megatron-to-hf", help="Megatron distributed checkpoint -> HF safetensors directory"
    )
    to_hf.add_argument(
        "--ckpt", required=True, metavar="DIR", help="checkpoint directory (saved at any TP×PP)"
    )
    to_hf.add_argument("--out", required=True, metavar="DIR", help="HF model directory to write")
    _add_layout_args(to_hf)
    to_hf.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *_DTYPES],
        metavar="{auto,fp32,bf16,fp16}",
        help="dtype of the written tensors (default auto: the checkpoint's)",
    )
    to_hf.add_argument(
        "--hf-config",
        default=None,
        metavar="DIR",
        help="HF directory giving config.json and tokenizer files, for checkpoints saved "
        "without them (default: the ones stored in the checkpoint)",
    )
    to_hf.add_argument(
        "--verify", action="store_true", help="compare logits with the written HF model"
    )
    to_hf.add_argument("--force", action="store_true", help="write into a non-empty --out")
    _add_verify_args(to_hf)

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
        _check_inputs(args)
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    world = args.tp * args.pp
    if world > 1 and not _inside_launched_world():
        return _spawn_workers(args, world)
    if not _inside_launched_world():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    try:
        return run_rank(args)
    except Exception:  # noqa: BLE001 - a bug: show it, with its own exit status
        traceback.print_exc()
        return EXIT_CRASH


# --------------------------------------------------------------------------------------------
# Input checks (cheap, in the launching process, before any worker starts)
# --------------------------------------------------------------------------------------------


def _check_inputs(args: argparse.Namespace) -> None:
    """Raise :class:`ConvertError` naming the path, architecture or size that is wrong."""
    for name in ("tp", "pp"):
        if getattr(args, name) < 1:
            raise ConvertError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.vpp is not None and (args.vpp < 1 or (args.vpp > 1 and args.pp < 2)):
        raise ConvertError(f"--vpp {args.vpp} needs --pp >= 2 (and --vpp >= 1)")
    if args.num_sequences < 1 or args.seq_len < 2:
        raise ConvertError("--num-sequences must be >= 1 and --seq-len >= 2")
    if args.command == "hf-to-megatron":
        _check_hf_dir(args.hf_path, "--hf-path", need_weights=True)
        _check_out(args.out, args.force)
        cfg = _read_json(Path(args.hf_path) / "config.json")
        where = Path(args.hf_path) / "config.json"
    else:
        meta = _check_ckpt(args.ckpt)
        if args.hf_config is not None:
            _check_hf_dir(args.hf_config, "--hf-config", need_weights=False)
            cfg = _read_json(Path(args.hf_config) / "config.json")
            where = Path(args.hf_config) / "config.json"
        elif "hf_config" in meta:
            cfg, where = meta["hf_config"], Path(args.ckpt) / _META_FILE
        else:
            raise ConvertError(
                f"--ckpt {args.ckpt} has no HF config in megarl_meta.json; pass --hf-config DIR"
            )
        if args.command == "verify":
            _check_hf_dir(args.hf_path, "--hf-path", need_weights=True)
        else:
            _check_out(args.out, args.force)
    dims = _checked_dims(cfg, args.tp, where)
    if args.command == "verify":
        hf_where = Path(args.hf_path) / "config.json"
        hf_dims = _checked_dims(_read_json(hf_where), args.tp, hf_where)
        if hf_dims != dims:
            diff = {
                f.name: (getattr(dims, f.name), getattr(hf_dims, f.name))
                for f in dataclasses.fields(dims)
                if getattr(dims, f.name) != getattr(hf_dims, f.name)
            }
            raise ConvertError(
                f"--hf-path {args.hf_path} is a different model from --ckpt {args.ckpt} "
                f"(checkpoint vs HF: {diff})"
            )
    _check_layout(dims, args.tp, args.pp, args.vpp, where)


def _checked_dims(cfg: dict, tp: int, where: Path):
    from megarl.models.hf_mapping import ModelDims, UnsupportedArchitectureError

    try:
        return ModelDims.from_hf_config(cfg, tp_size=tp)
    except UnsupportedArchitectureError as exc:
        raise ConvertError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConvertError(f"{where}: cannot read the model dimensions ({exc!r})") from None


def _check_hf_dir(path: str, flag: str, *, need_weights: bool) -> None:
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"{flag} {path} does not exist")
    if not p.is_dir():
        raise ConvertError(f"{flag} {path} is not a directory")
    if not (p / "config.json").is_file():
        raise ConvertError(f"{flag} {path} has no config.json (not a Hugging Face model directory)")
    if need_weights and not any(p.glob("*.safetensors")):
        raise ConvertError(f"{flag} {path} has no *.safetensors files")


def _check_out(path: str, force: bool) -> None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConvertError(f"--out {path} exists and is not a directory")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise ConvertError(f"--out {path} is not empty (pass --force to write into it)")


def _check_ckpt(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"--ckpt {path} does not exist")
    if not (p / "metadata.json").is_file():
        raise ConvertError(
            f"--ckpt {path} is not a Megatron distributed checkpoint (no metadata.json)"
        )
    return _read_json(p / _META_FILE) if (p / _META_FILE).is_file() else {}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConvertError(f"cannot read {path}: {exc}") from None


def _check_layout(dims, tp: int, pp: int, vpp: int | None, where: Path) -> None:
    for what, n in (
        ("num_attention_heads", dims.num_attention_heads),
        ("intermediate_size", dims.ffn_hidden_size),
    ):
        if n % tp:
            raise ConvertError(f"--tp {tp} does not divide {what}={n} of {where}")
    groups = dims.num_query_groups
    if groups % tp and tp % groups:
        raise ConvertError(
            f"--tp {tp} must divide or be a multiple of num_key_value_heads={groups} of {where}"
        )
    stages = pp * (vpp or 1)
    if dims.num_layers % stages:
        raise ConvertError(
            f"--pp {pp}{f' × --vpp {vpp}' if vpp else ''} does not divide "
            f"num_hidden_layers={dims.num_layers} of {where}"
        )


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


def _inside_launched_world() -> bool:
    """True under torchrun (RANK/WORLD_SIZE) or a multi-task srun step."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_workers(args: argparse.Namespace, world: int) -> int:
    """Run :func:`run_rank` in ``world`` local processes; returns the worst exit status.

    A worker that fails reports it through its pipe and then waits: the others are stopped
    first, so that none of them crashes on a vanished peer and buries the one-line error
    under a traceback.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs, pipes = [], {}
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(rank, world, port, args, send), name=f"rank{rank}")
        p.start()
        send.close()
        procs.append(p)
        pipes[recv] = p
    status = EXIT_OK
    try:
        alive = {p.sentinel: p for p in procs}
        while alive:
            for ready in wait([*alive, *pipes]):
                if ready in pipes:  # a failure report, or EOF when the worker ends
                    failed = pipes.pop(ready)
                    try:
                        code = ready.recv()
                    except EOFError:
                        continue
                    status = status or code
                    _terminate([p for p in procs if p is not failed])
                    _terminate([failed])
                elif ready in alive:
                    p = alive.pop(ready)
                    p.join()
                    if p.exitcode:  # died without a report (killed, crashed in start-up)
                        status = status or (p.exitcode if p.exitcode > 0 else EXIT_MISMATCH)
                        _terminate(procs)
    finally:
        _terminate(procs)
    return status


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, report) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        code = run_rank(args)
    except BaseException:  # noqa: BLE001 - a bug: show it, then stop the world cleanly
        traceback.print_exc()
        code = EXIT_CRASH
    if code not in (EXIT_OK, EXIT_MISMATCH):
        report.send(code)
        time.sleep(300)  # until the launcher terminates this process (after the others)
    sys.exit(code)


def run_rank(args: argparse.Namespace) -> int:
    """One rank's share of the command (collective: every rank of the world calls it)."""
    _quiet_third_party()
    import torch

    # Megatron (and with it torch._dynamo) must be imported before the CPU emulation patches
    # torch.cuda, or dynamo's import trips over the patched functions.
    import megarl.models.gpt  # noqa: F401
    from megarl.models.hf_mapping import UnsupportedArchitectureError
    from megarl.parallel.init import ParallelSizes, destroy_distributed, init_distributed

    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    try:
        init_distributed(ParallelSizes(args.tp, args.pp, args.vpp), seed=args.seed)
    except ValueError as exc:  # the launched world does not fit TP×PP
        _print_error(exc)
        return EXIT_USAGE
    user_errors = (
        ConvertError,
        UnsupportedArchitectureError,
        FileNotFoundError,
        KeyError,
        ValueError,
    )
    try:
        code = _COMMANDS[args.command](args)
    except user_errors as exc:
        _print_error(exc)
        return EXIT_USAGE  # no teardown: it would break the collectives the peers are in
    destroy_distributed()
    return code


def _print_error(exc: BaseException) -> None:
    """One ``error:`` line from the failing rank (ranks other than 0 say which they are)."""
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    world = int(os.environ.get("WORLD_SIZE", "1"))
    where = f"rank {_rank()}: " if world > 1 and _rank() != 0 else ""
    print(f"error: {where}{message}", file=sys.stderr, flush=True)


def _quiet_third_party() -> None:
    """Silence known-harmless warnings, and the dist-checkpoint 'overwriting' warning that our
    own ``megarl_meta.json`` (written before the shards) triggers."""
    import logging
    import warnings

    for pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    logging.getLogger("megatron.core.dist_checkpointing.serialization").addFilter(
        lambda record: "Overwriting old incomplete" not in record.getMessage()
    )
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


def _build_chunks(cfg: dict, args: argparse.Namespace, dtype_name: str):
    """This rank's model chunks, uninitialised (the caller loads every parameter).

    The vocabulary is padded for this TP; a checkpoint saved with another padding still loads
    (Megatron marks the embedding and output layer ``allow_shape_mismatch``).
    """
    import torch

    from megarl.models.gpt import build_gpt_chunks, build_transformer_config
    from megarl.models.hf_mapping import ModelDims

    dims = ModelDims.from_hf_config(cfg, tp_size=args.tp)
    config = build_transformer_config(
        dims,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        params_dtype=getattr(torch, dtype_name),
    )
    config.perform_initialization = False  # every parameter is overwritten by the load
    return dims, build_gpt_chunks(dims, config)


def hf_to_megatron(args: argparse.Namespace) -> int:
    """Load the HF directory into a model at ``--tp/--pp/--vpp`` and save a dist checkpoint."""
    from megarl.checkpoint.dist_ckpt import save_model_checkpoint
    from megarl.models.weights import load_hf_weights, read_hf_config

    t0 = time.perf_counter()
    hf_path = Path(args.hf_path).resolve()
    cfg = read_hf_config(hf_path)
    dtype = _DTYPES.get(args.dtype) or safetensors_dtype(hf_path)
    _log(f"building {cfg['architectures'][0]} ({dtype}, TP={args.tp} PP={args.pp}) ...")
    dims, chunks = _build_chunks(cfg, args, dtype)
    _log(f"loading HF weights from {hf_path} ...")
    with _indexed_view(hf_path) as indexed:
        try:
            load_hf_weights(chunks, indexed, dims)
        except KeyError as exc:  # name the user's directory, not the temporary view
            raise ConvertError(str(exc.args[0]).replace(str(indexed), str(hf_path))) from None
    out = Path(args.out)
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        copy_side_files(hf_path, out / HF_FILES_DIR, keep_config=True)
    meta = {
        "format": META_FORMAT,
        "hf_config": cfg,
        "source": str(hf_path),
        "dtype": dtype,
        "saved_layout": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp},
    }
    _log(f"saving Megatron distributed checkpoint to {out} ...")
    save_model_checkpoint(chunks, out, meta=meta)
    _log(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    del chunks
    if args.verify:
        return verify_logits(args, ckpt=out, hf_path=hf_path)
    return EXIT_OK


def megatron_to_hf(args: argparse.Namespace) -> int:
    """Load the dist checkpoint at ``--tp/--pp/--vpp`` and write an HF directory."""
    import torch

    from megarl.checkpoint.dist_ckpt import load_model_checkpoint, read_checkpoint_meta
    from megarl.models.weights import export_hf_weights

    t0 = time.perf_counter()
    ckpt = Path(args.ckpt)
    meta = read_checkpoint_meta(ckpt)
    cfg, side_dir = _ckpt_hf_config(ckpt, meta, args.hf_config)
    stored = meta.get("dtype") or _config_dtype(cfg)
    out_dtype = _DTYPES.get(args.dtype) or stored
    _log(f"loading {ckpt} ({stored}, TP={args.tp} PP={args.pp}) ...")
    dims, chunks = _build_chunks(cfg, args, stored)
    load_model_checkpoint(chunks, ckpt)
    out_cfg = dict(cfg)
    out_cfg["dtype"] = out_dtype
    if "torch_dtype" in out_cfg:
        out_cfg["torch_dtype"] = out_dtype
    _log(f"writing HF safetensors ({out_dtype}) to {args.out} ...")
    out = export_hf_weights(
        chunks,
        args.out,
        dims,
        source_dir=side_dir,
        hf_config=out_cfg,
        dtype=getattr(torch, out_dtype),
        progress=_log,
    )
    if _rank() == 0 and side_dir is not None:
        copy_side_files(side_dir, out, keep_config=False)  # those export_hf_weights skips
    _log(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    del chunks
    if args.verify:
        return verify_logits(args, ckpt=ckpt, hf_path=out)
    return EXIT_OK


def verify(args: argparse.Namespace) -> int:
    return verify_logits(args, ckpt=Path(args.ckpt), hf_path=Path(args.hf_path))


def _ckpt_hf_config(ckpt: Path, meta: dict, hf_config: str | None) -> tuple[dict, Path | None]:
    """(HF config dict, directory of tokenizer/config files) of a checkpoint."""
    from megarl.models.weights import read_hf_config

    if hf_config:
        return read_hf_config(hf_config), Path(hf_config)
    side = ckpt / HF_FILES_DIR
    return meta["hf_config"], side if side.is_dir() else None


def _config_dtype(cfg: dict) -> str:
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return _DTYPES.get(name, "float32")


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header


@contextlib.contextmanager
def _indexed_view(hf_path: Path) -> Iterator[Path]:
    """``hf_path``, or for a directory without ``model.safetensors.index.json`` a temporary view
    of it (symlinks plus a generated index).

    Works around :class:`megarl.models.weights.HFCheckpointReader`, which iterates a
    ``safe_open`` handle (not iterable in safetensors 0.7/0.8) when there is no index.
    """
    if (hf_path / "model.safetensors.index.json").exists():
        yield hf_path
        return
    with tempfile.TemporaryDirectory(prefix="megarl-hf-") as tmp:
        weight_map = {}
        for f in sorted(hf_path.glob("*.safetensors")):
            (Path(tmp) / f.name).symlink_to(f.resolve())
            weight_map.update({name: f.name for name in _safetensors_header(f)})
        index = {"metadata": {}, "weight_map": weight_map}
        (Path(tmp) / "model.safetensors.index.json").write_text(json.dumps(index))
        yield Path(tmp)


def safetensors_dtype(hf_path: str | Path) -> str:
    """dtype of the HF tensors (read from a safetensors header; the embedding's if present)."""
    files = sorted(Path(hf_path).glob("*.safetensors"))
    for f in files:
        header = _safetensors_header(f)
        if not header:
            continue
        entry = header.get("model.embed_tokens.weight") or next(iter(header.values()))
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ConvertError(f"{f}: unsupported tensor dtype {entry['dtype']}")
        return _SAFETENSORS_DTYPES[entry["dtype"]]
    raise ConvertError(f"no tensors in {hf_path}/*.safetensors")


def copy_side_files(src: Path, dst: Path, *, keep_config: bool) -> list[str]:
    """Copy the non-weight top-level files of an HF directory (tokenizer, generation config...)."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(Path(src).iterdir()):
        if not f.is_file() or f.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if f.name == "config.json" and not keep_config:
            continue
        shutil.copy2(f, dst / f.name)
        copied.append(f.name)
    return copied


# --------------------------------------------------------------------------------------------
# Logit verification
# --------------------------------------------------------------------------------------------


def verify_inputs(vocab_size: int, num_sequences: int, seq_len: int, seed: int) -> list:
    """Seeded random token sequences, longest first, of different lengths (>= 2 tokens)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = [
        max(2, seq_len - i * max(1, seq_len // (2 * num_sequences))) for i in range(num_sequences)
    ]
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def _coarser(a: str, b: str) -> str:
    """The less precise of two dtype names (float32 loses to either 16-bit type)."""
    return b if a == "float32" else a


def verify_logits(args: argparse.Namespace, *, ckpt: Path, hf_path: Path) -> int:
    """Compare the checkpoint's logits (Megatron, any layout) with the HF model's (transformers)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.checkpoint.dist_ckpt import load_model_checkpoint, read_checkpoint_meta
    from megarl.parallel.init import device

    t0 = time.perf_counter()
    meta = read_checkpoint_meta(ckpt)
    cfg, _ = _ckpt_hf_config(ckpt, meta, args.hf_config)
    common = _coarser(meta.get("dtype") or _config_dtype(cfg), safetensors_dtype(hf_path))
    _log(f"verifying {ckpt} against {hf_path} (float32 compute, weights as {common}) ...")
    dims, chunks = _build_chunks(cfg, args, "float32")
    load_model_checkpoint(chunks, ckpt)
    _round_params([p for c in chunks for p in c.parameters()], common)
    seqs = verify_inputs(dims.vocab_size, args.num_sequences, args.seq_len, args.seed)
    logits = megatron_logits(chunks, seqs, dims.vocab_size)
    del chunks
    reporter = (
        logits is not None
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    # [max |Δ|, max |logit|] from the reporting rank; the others contribute -1 to the MAX.
    result = torch.full((2,), -1.0, dtype=torch.float64, device=device())
    if reporter:
        ref = hf_logits(hf_path, seqs, common)
        diff = max(float((m - r).abs().max()) for m, r in zip(logits, ref, strict=True))
        scale = max(float(r.abs().max()) for r in ref)
        result = torch.tensor([diff, scale], dtype=torch.float64, device=device())
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    diff, scale = result.tolist()
    tol = args.atol + args.rtol * scale
    ok = diff <= tol
    if _rank() == 0:
        tokens = sum(len(s) for s in seqs)
        print(
            f"max |Δlogit| = {diff:.3e} over {len(seqs)} sequences ({tokens} tokens × "
            f"{dims.vocab_size} vocab; max |logit| {scale:.3g}); tolerance {tol:.3e}: "
            f"{'OK' if ok else 'MISMATCH'}",
            flush=True,
        )
    _log(f"verification took {time.perf_counter() - t0:.1f} s")
    return EXIT_OK if ok else EXIT_MISMATCH


def _round_params(params, dtype_name: str) -> None:
    import torch

    if dtype_name == "float32":
        return
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(getattr(torch, dtype_name)).to(p.dtype))


def megatron_logits(chunks, sequences: list, vocab_size: int) -> list | None:
    """Full-vocabulary float32 logits ``[len_i, vocab_size]`` per sequence (CPU tensors).

    Forward-only through Megatron's schedule (one sequence per micro-batch); the vocab-parallel
    logits are gathered over TP and the padding trimmed. Collective; returns None off the last
    pipeline stage.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.gpt import unwrap
    from megarl.models.runner import causal_mask

    dev = next(unwrap(chunks[0]).parameters()).device
    batches = [s.to(dev)[None] for s in sequences]
    collected: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        pos = torch.arange(ids.shape[1], device=dev)[None]
        output = model(ids, pos, causal_mask(ids.shape[1], dev))

        def loss_func(output_tensor):
            collected.append(output_tensor.detach())
            return output_tensor.sum() * 0.0, torch.ones((), dtype=torch.int), {}

        return output, loss_func

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
            model=list(chunks) if len(chunks) > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=max(b.shape[1] for b in batches),
            micro_batch_size=1,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = []
    for local in collected:
        local = local[0].float().contiguous()  # [S, V/tp]
        if tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
            local = torch.cat(parts, dim=-1)
        out.append(local[:, :vocab_size].cpu())
    return out


def hf_logits(hf_path: Path, sequences: list, round_to: str) -> list:
    """float32 logits of the HF model (``transformers``, CPU) for each sequence."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    model.eval()
    _round_params(list(model.parameters()), round_to)
    with torch.no_grad():
        return [model(input_ids=s[None]).logits[0].float() for s in sequences]


_COMMANDS = {
    "hf-to-megatron": hf_to_megatron,
    "megatron-to-hf": megatron_to_hf,
    "verify": verify,
}
