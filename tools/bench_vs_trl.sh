#!/usr/bin/env bash
# megarl against TRL on issue 59's equal-work GRPO step (4 prompts x 4 responses x 32 tokens,
# the tiny Qwen2, fp32, no KL, one update per generation), alternating in one window so both see
# the same machine: ROUNDS x (tools/bench_step.py at world 1, then tools/bench_trl.py), then both
# medians of the per-round medians and their ratio (TRL's seconds / megarl's: above 1, megarl is
# faster).
#   tools/bench_vs_trl.sh [ROUNDS=3] [TRL_PYTHON=/tmp/trl/bin/python]
# TRL_PYTHON is a Python with TRL (tools/bench_trl.py's docstring installs one).
set -euo pipefail
rounds=${1:-3}
trl_python=${2:-/tmp/trl/bin/python}
cd "$(dirname "$0")/.."
equal_work=(
  --nproc 1 --steps 8
  data.train_batch_size=4 actor_rollout_ref.rollout.n=4 data.max_response_length=32
  actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.use_kl_loss=false
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  # vLLM compiled: verl's and megarl's default; the tiny configs run eager only to start faster
  actor_rollout_ref.rollout.enforce_eager=false
)
megarl=() trl=()
for ((i = 1; i <= rounds; i++)); do
  step=$(.venv/bin/python tools/bench_step.py "${equal_work[@]}" | tee /dev/stderr |
    sed -n 's/^steps .*(median \([0-9.]*\) s)$/\1/p')
  megarl+=("$step")
  ref=$("$trl_python" tools/bench_trl.py --steps 8 2>/dev/null | tee /dev/stderr |
    sed -n 's/^trl .*median \([0-9.]*\) s per step.*/\1/p')
  trl+=("$ref")
done
python3 - "${megarl[*]}" "${trl[*]}" <<'PY'
import statistics, sys
megarl, trl = ([float(x) for x in arg.split()] for arg in sys.argv[1:])
m, t = statistics.median(megarl), statistics.median(trl)
print(f"megarl {m:.3f} s/step (rounds {megarl}), trl {t:.3f} s/step (rounds {trl}): "
      f"megarl at {t / m:.2f}x TRL's speed")
PY
