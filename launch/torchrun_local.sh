#!/usr/bin/env bash
# One machine, torchrun standalone: the laptop/CI twin of the Slurm scripts.
#
#   launch/torchrun_local.sh CONFIG.yaml [key=value ...]
#
#   MEGARL_NPROC   processes (default: the GPUs nvidia-smi lists; 2 without GPUs, the world of
#                  the tiny CPU configs)
#   MEGARL_PYTHON  interpreter with megarl installed (default: python)
#   MEGARL_TRAIN_MODULE  module torchrun runs (default: megarl.train)
#
# torchrun replaces this shell (exec), so Ctrl-C and SIGTERM reach it directly and it forwards
# them to the ranks (the stop protocol); a stop file (<run dir>/STOP) works here too.
set -euo pipefail

CONFIG=${1:?usage: launch/torchrun_local.sh CONFIG.yaml [key=value ...]}
shift
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if ((GPUS == 0)); then
    GPUS=2
fi
NPROC=${MEGARL_NPROC:-$GPUS}

exec "${MEGARL_PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
    -m "${MEGARL_TRAIN_MODULE:-megarl.train}" --config "$CONFIG" "$@" trainer.nnodes=1 "trainer.n_gpus_per_node=$NPROC"
