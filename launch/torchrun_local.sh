#!/usr/bin/env bash
# One machine, torchrun standalone: the laptop/CI twin of the Slurm scripts.
#
#   launch/torchrun_local.sh CONFIG.yaml [key=value ...]
#
#   MEGARL_NPROC   processes (default: the GPUs nvidia-smi lists; 2 without GPUs, the world of
#                  the tiny CPU configs)
#   MEGARL_PYTHON  interpreter with megarl installed (default: python)
#   MEGARL_TRAIN_MODULE  module torchrun runs (default: megarl.trainer)
#
# `megarl train` replaces this shell (exec): its pre-flight checks the run before anything is
# launched, then it runs torchrun; Ctrl-C, SIGTERM and SIGUSR1 become the trainer's stop
# request (a checkpoint of the step in flight, exit 0), a failure inside the ranks is one line,
# and killing it takes the ranks down (issue 23). A stop file (<run dir>/STOP) works here too.
set -euo pipefail

CONFIG=${1:?usage: launch/torchrun_local.sh CONFIG.yaml [key=value ...]}
shift
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if ((GPUS == 0)); then
    GPUS=2
fi
NPROC=${MEGARL_NPROC:-$GPUS}

exec "${MEGARL_PYTHON:-python}" -m megarl.cli train \
    --config "$CONFIG" "$@" trainer.nnodes=1 "trainer.n_gpus_per_node=$NPROC"
