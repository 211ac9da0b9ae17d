# shellcheck shell=bash
# The body of megarl's Slurm batch scripts (ppo_72b.slurm, grpo_7b.slurm source it). Shell only:
# every decision about the run is made by megarl (STYLE 11).
#
#   sbatch [SBATCH OPTIONS] launch/<job>.slurm [CONFIG.yaml] [key=value ...]
#
# Submit from the repository root (or set MEGARL_HOME). The first argument, when it ends in
# .yaml/.yml, replaces the script's config; every other argument is a dotted override passed to
# the trainer unchanged. Environment variables read here (all optional):
#
#   MEGARL_GPUS_PER_NODE    processes per node (default: the GPUs Slurm allocated, else 8); a
#                           node without GPUs runs the same script with e.g. 2 (CPU configs)
#   MEGARL_PYTHON           interpreter with megarl installed (default: python)
#   MEGARL_TRAIN_MODULE     module torchrun runs (default: megarl.trainer; a wrapper of your own,
#                           or the stand-ins with which the tests exercise this script)
#   MEGARL_LOG_DIR          parent of the per-job log directory (default: <run dir>/logs)
#   MEGARL_REQUEUE=1        after a clean stop on USR1/TERM, requeue this job to resume
#   MEGARL_CONTAINER_IMAGE  run inside this image with pyxis/enroot (srun --container-image)
#   MEGARL_CONTAINER_MOUNTS its --container-mounts (default: the submit directory)
#   MASTER_PORT             rendezvous port (default: 29500 + job id mod 1000)
#   NCCL_*, CUDA_*          passed through; defaults below
#   GLOO_SOCKET_IFNAME      gloo's interface; unset, each rank of a multi-node job sets it to
#                           the interface routing to MASTER_ADDR (megarl.parallel.network):
#                           vLLM and Megatron build gloo groups over the whole world
#   MEGARL_DIST_TIMEOUT_MINUTES  collective timeout (default 180: a 72B checkpoint save can
#                           outlast PyTorch's 30 minutes; megarl.parallel.init)
#
# Launcher: one srun task per node running `megarl train` as one node of the job (it starts
# torchrun with c10d rendezvous), not one srun task per GPU. The trainer is a torchrun program
# (`python -m megarl.trainer` reads RANK, LOCAL_RANK, WORLD_SIZE from torchrun), so a Slurm job and
# a laptop run go through the same entry, environment and failure report; torchrun kills the
# node's other workers when one of them dies, and srun --kill-on-bad-exit=1 then ends the other
# nodes: a dead rank ends the job instead of hanging it until the NCCL timeout.
#
# Preemption and time limits: #SBATCH --signal=B:USR1@<lead> sends USR1 to this shell only.
# Bash runs a trap only after the foreground command returns, so srun runs in the background
# and the script waits for it in a loop; the trap writes <run dir>/STOP, the trainer sees it at
# the end of the current step, saves a checkpoint, exits 0, and this script exits 0. A
# requeued (--requeue, or MEGARL_REQUEUE=1) or chained job then resumes from that checkpoint.
# A --time shorter than the lead time sends USR1 at once: the job stops after its first step.
# scancel without --signal, a time limit reached and a preemption instead send SIGTERM to every
# process of the job at once and SIGKILL KillWait seconds later (torchrun's own limit: 30 s).
# Each rank takes its SIGTERM, and the one torchrun forwards, as one stop request: the step in
# flight is saved only when it and the save fit in that window. Size the USR1 lead instead.

set -euo pipefail

cd "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-.}}"
CONFIG=$MEGARL_DEFAULT_CONFIG
case "${1:-}" in
    *.yaml | *.yml) CONFIG=$1; shift ;;
esac
PYTHON=${MEGARL_PYTHON:-python}
GPUS_PER_NODE=${MEGARL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_NNODES:-1}

CONTAINER=()
if [[ -n "${MEGARL_CONTAINER_IMAGE:-}" ]]; then
    CONTAINER=(--container-image="$MEGARL_CONTAINER_IMAGE" --container-workdir="$PWD"
        --container-mounts="${MEGARL_CONTAINER_MOUNTS:-$PWD:$PWD}")
fi

# The node and process counts come from the allocation and win over the config file's: megarl
# makes trainer.nnodes the job's nodes less actor_rollout_ref.rollout.nnodes (vLLM's own nodes).
OVERRIDES=("$@" "trainer.n_gpus_per_node=$GPUS_PER_NODE")

# megarl checks the run once before any node starts (config, files, data, reward function, the
# checkpoint a resume would load: one line and exit 2 on a problem) and resolves the run
# directory (trainer.default_local_dir after overrides), so the stop file lands where the
# trainer looks, whatever the config and overrides say.
RC=0
RUN_DIR=$(srun --nodes=1 --ntasks=1 "${CONTAINER[@]}" "$PYTHON" -m megarl.cli train --check \
    --nodes="$NNODES" --config "$CONFIG" "${OVERRIDES[@]}") || RC=$?
if ((RC != 0)); then
    echo "megarl: job $SLURM_JOB_ID: the pre-flight check failed (status $RC); nothing launched"
    exit "$RC"
fi
STOP_FILE=$RUN_DIR/STOP
LOG_DIR=${MEGARL_LOG_DIR:-$RUN_DIR/logs}/job-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}
mkdir -p "$LOG_DIR"
rm -f "$STOP_FILE" # a stop request that an earlier job already honoured

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}

# Megatron issues TP/SP communication and compute kernels in an order that overlaps them only
# when the GPU works them off one hardware queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A failed or timed-out NCCL collective aborts the process (then torchrun and srun end the job)
# instead of leaving the other ranks blocked.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# InfiniBand: ride out short link flaps on large jobs (4.096 us x 2^22 ~ 17 s per retry) rather
# than failing the job. Set NCCL_IB_HCA / NCCL_SOCKET_IFNAME for your fabric if NCCL's choice
# is wrong; they pass through.
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1

echo "megarl: job $SLURM_JOB_ID: $NNODES node(s) x $GPUS_PER_NODE process(es), $CONFIG" \
    "${OVERRIDES[*]}; run directory $RUN_DIR; logs $LOG_DIR"

STOPPING=0
# shellcheck disable=SC2329 # invoked by the traps below
request_stop() {
    if [[ $STOPPING == 0 ]]; then
        echo "megarl: $1 received: the trainer stops after this step ($STOP_FILE)"
        echo "SIG$1 to Slurm job $SLURM_JOB_ID" >"$STOP_FILE" # the trainer's stop line names it
        STOPPING=1
    fi
}
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM

# One `megarl train` per node: torchrun in the job's rendezvous, torchrun's own output in
# $LOG_DIR/<node>.log, megarl's lines (and a failure inside the ranks, as one line) here.
srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks-per-node=1 --cpu-bind=none \
    "${CONTAINER[@]}" "$PYTHON" -m megarl.cli train \
    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" --log-dir="$LOG_DIR" \
    --nodes="$NNODES" --config "$CONFIG" "${OVERRIDES[@]}" &
SRUN_PID=$!
while true; do
    RC=0
    wait "$SRUN_PID" || RC=$?
    # Above 128 with srun still alive: a trapped signal interrupted wait; keep waiting.
    if ((RC <= 128)) || ! kill -0 "$SRUN_PID" 2>/dev/null; then
        break
    fi
done
echo "megarl: job $SLURM_JOB_ID: trainer exited with status $RC"

if [[ $STOPPING == 1 && $RC == 0 && ${MEGARL_REQUEUE:-0} == 1 ]]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$RC"
