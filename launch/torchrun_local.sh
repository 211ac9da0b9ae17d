#!/usr/bin/env bash
# One machine, torchrun standalone: the laptop/CI twin of the Slurm scripts.
#
#   launch/torchrun_local.sh CONFIG.yaml [key=value ...]
#
#   MEGARL_NPROC   processes (default: the GPUs torch will see, CUDA_VISIBLE_DEVICES honoured;
#                  2 without GPUs, the world of the tiny CPU configs)
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

# The GPUs torch will see. nvidia-smi lists every GPU of the machine whatever
# CUDA_VISIBLE_DEVICES says; counting those would start ranks that share GPUs (vLLM then asserts
# local_rank < device_count). Where the variable is set, CUDA reads its entries up to the first
# invalid one (an index not below the GPU count, or neither an index nor a GPU-/MIG- UUID); set
# but empty: no GPU.
count_gpus() {
    local listed entry count=0
    local -a visible
    listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [[ -z ${CUDA_VISIBLE_DEVICES+set} ]]; then
        echo "$listed"
        return
    fi
    IFS=',' read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
    for entry in "${visible[@]}"; do
        entry=${entry// /}
        if [[ $entry =~ ^[0-9]+$ ]]; then
            ((10#$entry < listed)) || break
        elif [[ $entry != GPU-* && $entry != MIG-* ]]; then
            break
        fi
        count=$((count + 1))
    done
    echo "$count"
}

GPUS=$(count_gpus)
if ((GPUS == 0)); then
    GPUS=2
fi
NPROC=${MEGARL_NPROC:-$GPUS}
# Megatron's TP/SP communication overlap relies on one CUDA work queue (the user's value wins).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

exec "${MEGARL_PYTHON:-python}" -m megarl.cli train \
    --config "$CONFIG" "$@" trainer.nnodes=1 "trainer.n_gpus_per_node=$NPROC"
