"""Checks ``make venv-gpu`` and ``make wheelhouse`` run before they download or build anything.

    python tools/gpu_preflight.py before [--wheelhouse DIR] [--build-te]   # Python, CUDA toolkit
    .venv-gpu/bin/python tools/gpu_preflight.py cuda [--no-gpu]            # after torch is in

Each refusal is one line on stderr and exit 2; a passing check prints one line on stdout.

- ``before``: the interpreter is one the pins allow (vLLM 0.32.0 and megarl: >= 3.11; vLLM 0.32.0:
  < 3.15); with ``--wheelhouse`` it was built for this Python (its ``PYTHON`` file); and where
  Transformer Engine's PyTorch extension will be compiled here (``--build-te``, or a wheelhouse
  without its wheel) the CUDA 13 toolkit is there: ``nvcc`` 13.x and ``cudnn.h`` where TE 2.9's
  build looks (its fallback to the pip wheels' headers breaks on TE 2.9 with CUDA 13).
- ``cuda``: the installed torch is a CUDA build and sees a GPU; if not, why (a CPU wheel, no
  driver, a driver older than CUDA 13 needs). ``--no-gpu`` (``make ... NO_GPU=1``: checking a
  wheelhouse on a machine without a GPU) only says that nothing was checked.

Runs on any Python 3 (a too-old interpreter must get the one line, not a SyntaxError), imports
only the standard library (and torch for ``cuda``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PYTHON_MIN = (3, 11)
"""vLLM 0.32.0 (``Requires-Python >=3.11,<3.15``) and megarl (``>=3.11``)."""
PYTHON_MAX = (3, 15)
"""vLLM 0.32.0's upper bound (exclusive)."""
CUDA_MAJOR = 13
"""torch 2.13.0's Linux wheel on PyPI is built for CUDA 13 (vLLM 0.32.0 pins that torch)."""
DRIVER_MIN = 580
"""The oldest NVIDIA driver branch for CUDA 13.0 (NVIDIA's CUDA 13.0 release notes: >= 580)."""
TE_TORCH_WHEEL = "transformer_engine_torch-*.whl"
"""Transformer Engine's PyTorch extension, built by ``make wheelhouse`` where it has a toolkit."""
WHEELHOUSE_PYTHON = "PYTHON"
"""The file in a wheelhouse naming the Python it was built for (``3.11``)."""


def check_python(version: tuple[int, ...]) -> str | None:
    """Why the pins cannot install on Python ``version``, or None."""
    if not PYTHON_MIN <= tuple(version[:2]) < PYTHON_MAX:
        have = ".".join(map(str, version[:3]))
        return (
            f"Python {have} is not supported: the GPU pins need >= 3.11 and < 3.15 "
            "(vLLM 0.32.0); pass another interpreter: make venv-gpu PY=python3.12"
        )
    return None


def check_wheelhouse(wheelhouse: Path, version: tuple[int, ...]) -> str | None:
    """Why ``wheelhouse`` cannot install on Python ``version``, or None."""
    tag = wheelhouse / WHEELHOUSE_PYTHON
    if not tag.is_file():
        return (
            f"{wheelhouse} is not a wheelhouse of `make wheelhouse` (no {WHEELHOUSE_PYTHON} file)"
        )
    built, have = tag.read_text().strip(), f"{version[0]}.{version[1]}"
    if built != have:
        return (
            f"{wheelhouse} was built for Python {built}, this is Python {have}: build it with "
            f"the cluster's Python (make wheelhouse PY=python{have})"
        )
    return None


def nvcc_path(env: dict[str, str]) -> Path | None:
    """Where Transformer Engine 2.9's build looks for nvcc (``build_tools/utils.py``):
    ``$CUDA_HOME/bin``, then ``PATH``, then ``/usr/local/cuda/bin``."""
    if env.get("CUDA_HOME"):
        return Path(env["CUDA_HOME"]) / "bin" / "nvcc"
    found = shutil.which("nvcc", path=env.get("PATH", ""))
    return Path(found) if found else Path("/usr/local/cuda/bin/nvcc")


def nvcc_release(nvcc: Path) -> tuple[int, int] | None:
    """``nvcc -V``'s release (13, 0), or None when it does not run or says none."""
    try:
        out = subprocess.run(
            [str(nvcc), "-V"], check=False, capture_output=True, text=True, timeout=60
        )
    except OSError:
        return None
    match = re.search(r"release\s*(\d+)\.(\d+)", out.stdout)
    return (int(match.group(1)), int(match.group(2))) if match else None


def cudnn_header_dirs(nvcc: Path, env: dict[str, str]) -> list[Path]:
    """Where the compile finds ``cudnn.h``: the toolkit's include directory TE 2.9 passes
    (``$CUDA_HOME/include``, else next to nvcc), the compiler's ``CPATH`` /
    ``CPLUS_INCLUDE_PATH``, and the system's include directories (Debian/Ubuntu packages)."""
    root = Path(env["CUDA_HOME"]) if env.get("CUDA_HOME") else nvcc.parent.parent
    dirs = [root / "include"]
    for var in ("CPATH", "CPLUS_INCLUDE_PATH"):
        dirs += [Path(p) for p in env.get(var, "").split(os.pathsep) if p]
    return dirs + [Path("/usr/include"), Path("/usr/include/x86_64-linux-gnu")]


def check_toolkit(env: dict[str, str]) -> str | None:
    """Why Transformer Engine's PyTorch extension cannot be compiled here, or None."""
    nvcc = nvcc_path(env)
    if not nvcc.is_file():
        return (
            f"nvcc not found ({nvcc}): Transformer Engine's PyTorch extension is compiled here "
            f"and needs the CUDA {CUDA_MAJOR} toolkit (set CUDA_HOME or put nvcc on PATH)"
        )
    release = nvcc_release(nvcc)
    if release is None or release[0] != CUDA_MAJOR:
        found = "no release" if release is None else f"release {release[0]}.{release[1]}"
        return (
            f"{nvcc} reports {found}; torch 2.13.0's wheel is built for CUDA {CUDA_MAJOR}, and "
            f"Transformer Engine must be compiled with nvcc {CUDA_MAJOR}.x (set CUDA_HOME)"
        )
    dirs = cudnn_header_dirs(nvcc, env)
    if not any((d / "cudnn.h").is_file() for d in dirs):
        return (
            f"cudnn.h not found in {dirs[0]} (nor CPATH, /usr/include): Transformer Engine's "
            "build needs cuDNN's headers beside the toolkit's (TE 2.9's fallback to the pip "
            "wheels' headers breaks); install cuDNN 9 for CUDA 13 (libcudnn9-dev-cuda-13)"
        )
    if shutil.which("g++", path=env.get("PATH", "")) is None:
        return "g++ not found: Transformer Engine's PyTorch extension is compiled with it"
    return None


def check_cuda(
    torch_version: str, cuda: str | None, available: bool, driver: str | None
) -> str | None:
    """Why the installed torch cannot use a GPU here, or None. ``cuda``: ``torch.version.cuda``;
    ``driver``: the NVIDIA driver's version (None: no driver found)."""
    if not cuda:
        return (
            f"torch {torch_version} is a CPU build; venv-gpu needs the CUDA wheel (PyPI's Linux "
            "wheel, or a wheelhouse built by make wheelhouse)"
        )
    if available:
        return None
    if driver is None:
        return (
            f"torch {torch_version} (CUDA {cuda}) sees no GPU and no NVIDIA driver was found "
            "(nvidia-smi, /proc/driver/nvidia/version); NO_GPU=1 installs without a GPU"
        )
    major = int(driver.split(".")[0]) if driver.split(".")[0].isdigit() else 0
    if major < DRIVER_MIN:
        return (
            f"NVIDIA driver {driver} is too old for torch {torch_version} (CUDA {cuda}): "
            f"CUDA {CUDA_MAJOR} needs driver {DRIVER_MIN} or newer"
        )
    return (
        f"torch {torch_version} (CUDA {cuda}) sees no GPU although driver {driver} is loaded "
        "(CUDA_VISIBLE_DEVICES? a container without --gpus?)"
    )


def driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version, or None."""
    proc = Path("/proc/driver/nvidia/version")
    if proc.is_file():
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", proc.read_text())
        if match:
            return match.group(1)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except OSError:
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def _before(args: argparse.Namespace) -> str | None:
    version = tuple(sys.version_info[:3])
    problem = check_python(version)
    if problem is None and args.wheelhouse:
        problem = check_wheelhouse(Path(args.wheelhouse), version)
    prebuilt = args.wheelhouse and any(Path(args.wheelhouse).glob(TE_TORCH_WHEEL))
    if problem is None and (args.build_te or (args.wheelhouse and not prebuilt)):
        problem = check_toolkit(dict(os.environ))
    if problem is None:
        te = ""
        if args.build_te or args.wheelhouse:
            where = "prebuilt in the wheelhouse" if prebuilt else "compiled here: toolkit ok"
            te = f"; Transformer Engine's PyTorch extension {where}"
        print(f"preflight: Python {version[0]}.{version[1]} ok{te}")
    return problem


def _cuda(args: argparse.Namespace) -> str | None:
    if args.no_gpu:  # nothing imported: torch's CUDA build loads no driver, but needs none here
        from importlib.metadata import PackageNotFoundError, version

        try:
            torch = f"torch {version('torch')}"
        except PackageNotFoundError:
            torch = "no torch"
        print(f"preflight: {torch}; no GPU check (NO_GPU=1)")
        return None
    import torch

    problem = check_cuda(
        torch.__version__, torch.version.cuda, torch.cuda.is_available(), driver_version()
    )
    if problem is None:
        print(f"preflight: torch {torch.__version__} sees {torch.cuda.device_count()} GPU(s)")
    return problem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="check", required=True)
    before = sub.add_parser("before", help="the Python, a wheelhouse's Python, the CUDA toolkit")
    before.add_argument("--wheelhouse", help="the wheelhouse venv-gpu installs from")
    before.add_argument("--build-te", action="store_true", help="TE's extension is built here")
    cuda = sub.add_parser("cuda", help="the installed torch sees a GPU")
    cuda.add_argument("--no-gpu", action="store_true", help="a machine without a GPU: skip")
    args = parser.parse_args(argv)
    problem = _before(args) if args.check == "before" else _cuda(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
