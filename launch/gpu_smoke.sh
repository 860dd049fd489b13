#!/usr/bin/env bash
# GPU smoke test: the tests marked `gpu`, then cache -> train -> eval (greedy and sampled, chain and tree) -> export
# -> export check on the embedded default verifier in bf16, on one GPU. About 5 minutes on an H100-class GPU.
#
#   launch/gpu_smoke.sh                     # writes under runs/gpu_smoke
#   RUN=/scratch/smoke DTYPE=float16 launch/gpu_smoke.sh
#
# Environment: RUN (output folder), DTYPE (verifier dtype, default bfloat16), PYTHON (default .venv/bin/python, else
# python3), DEVICE (default cuda; `cpu` runs the same steps on a CPU, for checking this script where no GPU is).
# Every step prints its command; the script stops at the first failure and exits with its status.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
RUN=${RUN:-runs/gpu_smoke}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
FLEDGE=("$PYTHON" -m fledge.launch.cli)

if [[ $DEVICE == cuda* ]] && ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_smoke.sh: no CUDA device is visible to $PYTHON (set DEVICE=cpu to run the steps on the CPU)" >&2
  exit 2
fi

step() {
  echo "== $*"
  local start=$SECONDS
  "$@"
  echo "== done in $((SECONDS - start)) s"
}

if [[ $DEVICE == cuda* ]]; then
  step "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
fi

VERIFIER=(verifier.dtype="$DTYPE")
step "${FLEDGE[@]}" cache "${VERIFIER[@]}" cache.device="$DEVICE" cache.dir="$RUN/cache" data.max_conversations=48 \
  data.max_length=512 cache.draft_vocab_size=4096
step "${FLEDGE[@]}" train cache_dir="$RUN/cache" output_dir="$RUN/train" engine.device="$DEVICE" train.max_steps=40 \
  ttt.ttt_steps=4 eval.holdout=4 eval.every=20 checkpoint.every=20 log.wandb_mode=offline
for method in chain tree; do
  for temperature in 0 0.7; do
    # Greedy in bf16: outputs may part from plain decoding at near-ties; the report counts ties and mismatches.
    step "${FLEDGE[@]}" eval draft="$RUN/train" "${VERIFIER[@]}" eval.method="$method" eval.temperature="$temperature" \
      eval.max_prompts=8 eval.max_new_tokens=64 eval.out_dir="$RUN/eval-$method-$temperature" wandb_mode=disabled
  done
done
step "${FLEDGE[@]}" export checkpoint="$RUN/train" out_dir="$RUN/export" report="$RUN/eval-chain-0/report.json"
step "${FLEDGE[@]}" export check "$RUN/export"
echo "gpu_smoke.sh: all steps passed ($DEVICE, $DTYPE); outputs under $RUN"
