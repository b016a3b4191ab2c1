# Two commands a new user needs: `make quickstart` and `make test` (each installs first).
# Python 3.11 (sglang 0.5.23 and torch 2.14.1's pins; pyproject requires >=3.11,<3.12): python3.11 when
# the machine has it, else python3 (checked below); PYTHON=/path/to/python3.11 to choose.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_DIR := .cache/tiny-model
STAMP := $(VENV)/.rlsys-installed
# -qq: errors only (pip's warnings include the machine's index notes and, for an editable install,
# setuptools' build notes; neither asks anything of the user). PYTHONWARNINGS=ignore on the last
# step keeps setuptools' "editable installation" note out of the build output.
PIP := $(BIN)/pip install -qq

.PHONY: install install-gpu quickstart quickstart-vlm test test-fast test-gpu lint clean chromium iptables bench check-install check-python bytecode

# torch first (2.14.1 lies on local disk), then SGLang's pure-Python runtime deps, then sglang
# itself without its CUDA-only kernel packages, then rlsys. See requirements/sglang-cpu.txt.
# sglang's own requirements name CUDA-only packages (its kernels, torchaudio, ...) that a CPU
# install leaves out on purpose, so pip's "sglang requires X, which is not installed" check is
# silenced (--no-warn-conflicts) from the sglang step on; `make check-install` runs pip check.
check-python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else \
		"rlsys: needs Python 3.11 (sglang 0.5.23, torch 2.14.1); $(PYTHON) is %d.%d: set PYTHON=/path/to/python3.11" % sys.version_info[:2])'

$(STAMP): pyproject.toml requirements/sglang-cpu.txt requirements/environments.txt
	@$(MAKE) --no-print-directory check-python
	@echo "rlsys: [1/6] virtualenv $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@echo "rlsys: [2/6] torch 2.14.1 (from local disk)"
	@$(PIP) torch==2.14.1 torchvision==0.29.1
	@echo "rlsys: [3/6] SGLang's runtime dependencies (CPU: no CUDA kernels)"
	@$(PIP) --no-warn-conflicts -r requirements/sglang-cpu.txt
	@echo "rlsys: [4/6] sglang 0.5.23 (without its dependency list)"
	@$(PIP) --no-warn-conflicts --no-deps sglang==0.5.23
	@echo "rlsys: [5/6] rlsys and its test, data, plot and tracking extras"
	@PYTHONWARNINGS=ignore $(PIP) --no-warn-conflicts -e '.[test]'
	@echo "rlsys: [6/6] environment hubs: verifiers 0.3.1, openenv-core 0.3.0 (pinned, without their dependency lists)"
	@$(PIP) --no-warn-conflicts --no-deps -r requirements/environments.txt
	@$(BIN)/python requirements/declare_top_level.py
	@touch $(STAMP)
	@echo "rlsys: installed into $(VENV)"

# What pip's resolver would say about the install (only sglang's CUDA-only packages should be missing).
check-install: $(STAMP)
	-$(BIN)/pip check

install: $(STAMP)

# On a CUDA host: the full SGLang (with its CUDA kernels) and the `gpu` extra (flash-attn is
# compiled against the installed torch, hence --no-build-isolation; it takes a while).
install-gpu: check-python
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel ninja packaging
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q sglang==0.5.23
	$(BIN)/pip install -q --no-build-isolation -e '.[test,gpu]'
	$(BIN)/pip install -q --no-deps -r requirements/environments.txt
	touch $(STAMP)

$(MODEL_DIR)/config.json: $(STAMP)
	$(BIN)/rlsys make-tiny-model $(MODEL_DIR)

quickstart: $(MODEL_DIR)/config.json
	$(BIN)/rlsys train configs/quickstart.yaml

VLM_DIR := .cache/tiny-vlm

$(VLM_DIR)/config.json: $(STAMP)
	$(BIN)/rlsys make-tiny-model --arch qwen2_5_vl $(VLM_DIR)

# The vision-language quickstart: a tiny Qwen2.5-VL names the colour of a square in an image.
quickstart-vlm: $(VLM_DIR)/config.json
	$(BIN)/rlsys train configs/quickstart_vlm.yaml

# The browser test drives Debian's chromium; install it when missing (needs root, as on CI).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null) || echo "rlsys: could not install chromium"

# The multi-node tests' firewalled node drops packets with iptables (in the node's namespace only).
iptables:
	@command -v iptables >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq iptables >/dev/null) || echo "rlsys: could not install iptables"

# Two streams of pytest sessions side by side (tests/e2e alone kept 1.5 of 2 cores busy: each test
# waits on engines, Ray and subprocesses in turn). The first: the e2e tests on the session's Ray
# cluster and engine sets (marked shared_cluster by tests/conftest.py), live on the output. The
# second, about as long: tests/unit (start no process) on both cores, then the e2e tests on their
# session cluster but none of its shared engine sets (second_stream: trainer tests, the architectures'
# own engine sets) on a Ray cluster of that session's own, then the e2e
# tests with clusters and engines of their own (own_engines, multi-node, ...); its output is kept in
# test-artifacts/suite-own.log and printed when the first ends. Each session counts only the SGLang
# servers and Ray clusters it started, into $(STARTS), summed at the end against the suite's budget
# (tests/start_ledger.py). Any session failing fails the target.
OWN_LOG := test-artifacts/suite-own.log
STARTS := test-artifacts/starts.jsonl
# rlsys's own modules compiled, as pip compiles what it installs: an editable install is imported from
# the source tree, and where PYTHONDONTWRITEBYTECODE is set (as on these machines) no process writes
# the .pyc it compiles, so each compiled ~0.4 CPU-s of rlsys anew (every driver, rank and command of a
# test run: hundreds). Up to date in a fraction of a second; a file edited since is compiled again.
bytecode: install
	@$(BIN)/python -m compileall -q -j 0 rlsys actors rollout weight_sync tests

test: install bytecode chromium iptables
	@mkdir -p test-artifacts; rm -f $(STARTS); export RLSYS_START_LEDGER=$(STARTS); \
	( $(BIN)/python -m pytest -q -n 2 -m "not slow" tests; unit=$$?; \
	  $(BIN)/python -m pytest -q --durations=15 -m "slow and second_stream" tests; second=$$?; \
	  $(BIN)/python -m pytest -q --durations=25 -m "slow and not shared_cluster" tests; own=$$?; \
	  test $$unit -eq 0 -a $$second -eq 0 -a $$own -eq 0 ) > $(OWN_LOG) 2>&1 & second=$$!; \
	$(BIN)/python -m pytest -q --durations=25 -m "slow and shared_cluster and not second_stream" tests; shared=$$?; \
	wait $$second; own=$$?; \
	echo "==== tests/unit, the second_stream e2e tests, then those with clusters and engines of their own ($(OWN_LOG)) ===="; \
	cat $(OWN_LOG); \
	$(BIN)/python -m tests.start_ledger $(STARTS); \
	test $$shared -eq 0 -a $$own -eq 0

# The `gpu`-marked tests (they skip without CUDA), then the one-GPU smoke run.
test-gpu:
	$(BIN)/python -m pytest -q -m gpu tests
	bash deploy/gpu_smoke.sh

# rlsys against TRL's GRPOTrainer on the same work (TRL 1.16 is a test dependency, in the same
# virtualenv): one JSON object (bench/vs_trl.py); `--learning` for steps to a target eval instead.
bench: install
	$(BIN)/python bench/vs_trl.py --out bench/results/vs_trl-$$(date +%F).json

test-fast: install bytecode
	$(BIN)/python -m pytest -q -n 2 -m "not slow" tests

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache
