#!/usr/bin/env bash
# Launch a fledge stage (default: train) under torchrun; every argument after NPROC is a Hydra override.
#
#   single node:  launch/torchrun.sh 2 cache_dir=runs/cache engine.kind=ddp
#                 launch/torchrun.sh 8 engine.kind=deepspeed engine.zero_stage=2      (torchrun can start DeepSpeed too)
#   many nodes:   on every node, the same command with its NODE_RANK:
#                 NNODES=2 NODE_RANK=0 MASTER=node0:29500 launch/torchrun.sh 8 engine.kind=ddp ...
#
# Environment: STAGE (a fledge sub-command, default train), NNODES / NODE_RANK / MASTER (host:port of the
# rendezvous, multi-node only), PYTHON (default: the repo's .venv, else python3). On CPU-only machines the
# processes use gloo; set OMP_NUM_THREADS to the cores per process.
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
NNODES=${NNODES:-1}

args=(--nproc_per_node "$NPROC")
if [[ "$NNODES" -gt 1 ]]; then
  : "${NODE_RANK:?NODE_RANK is required when NNODES > 1}" "${MASTER:?MASTER=host:port is required when NNODES > 1}"
  args+=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_backend c10d --rdzv_endpoint "$MASTER"
         --rdzv_id "${RDZV_ID:-fledge}")
else
  args+=(--standalone)
fi

cd "$ROOT"
if [[ $("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))') == 0 ]]; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi
exec "$PYTHON" -m torch.distributed.run "${args[@]}" -m fledge.launch.cli "${STAGE:-train}" "$@"
