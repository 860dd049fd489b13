#!/usr/bin/env bash
# Train under the DeepSpeed launcher (engine.kind=deepspeed); every argument after NPROC is a Hydra override.
#
#   one node:     launch/deepspeed.sh 8 cache_dir=runs/cache engine.zero_stage=2
#   many nodes:   HOSTFILE=launch/hostfile launch/deepspeed.sh 8 engine.zero_stage=3
#                 (run on the first host; the launcher reaches the others over ssh/pdsh; NPROC is per node)
#   CPU:          launch/deepspeed.sh 2 ...      (DS_ACCELERATOR=cpu and gloo are set up when there is no GPU)
#
# Environment: HOSTFILE (MPI-style "host slots=N" lines, see launch/hostfile.example), MASTER_PORT (default
# 29500), PYTHON (default: the repo's .venv, else python3). With a hostfile, FLEDGE_*, WANDB_*, HF_* and
# TRANSFORMERS_* variables reach every host.
set -euo pipefail
# Sequence lengths vary per step: expandable segments keep the CUDA allocator from fragmenting (ignored on CPU).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
NPROC=$1
shift

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$([[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || echo python3)}
DEEPSPEED=$(dirname "$PYTHON")/deepspeed
[[ -x "$DEEPSPEED" ]] || DEEPSPEED=deepspeed

# --no_local_rank: fledge reads LOCAL_RANK from the environment; a --local_rank argument would not be a valid
# Hydra override.
args=(--no_local_rank --master_port "${MASTER_PORT:-29500}")
if [[ -n "${HOSTFILE:-}" ]]; then
  args+=(--hostfile "$HOSTFILE" --num_gpus "$NPROC")
  # The launcher passes only a few variables to the other hosts; hand it fledge's (FLEDGE_RUNS places the presets'
  # folders, FLEDGE_HOME the converted verifiers), wandb's and Hugging Face's through a DeepSpeed env file.
  if [[ -z "${DS_ENV_FILE:-}" ]]; then
    DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/fledge-deepspeed-env.XXXXXX")
    env | grep -E '^(FLEDGE_|WANDB_|HF_|TRANSFORMERS_|OMP_NUM_THREADS=)' > "$DS_ENV_FILE" || true
    export DS_ENV_FILE
  fi
else
  args+=(--num_gpus "$NPROC")
fi

cd "$ROOT"
if [[ $("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))') == 0 ]]; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi
exec "$DEEPSPEED" "${args[@]}" --module fledge.launch.cli train engine.kind=deepspeed "$@"
