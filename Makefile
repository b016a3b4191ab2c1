# Two commands a new user needs: `make quickstart` and `make test` (each installs first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_DIR := .cache/tiny-model
STAMP := $(VENV)/.rlsys-installed

.PHONY: install quickstart test test-fast lint clean chromium

# torch first (2.14.1 lies on local disk), then SGLang's pure-Python runtime deps, then sglang
# itself without its CUDA-only kernel packages, then rlsys. See requirements/sglang-cpu.txt.
$(STAMP): pyproject.toml requirements/sglang-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -r requirements/sglang-cpu.txt
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

$(MODEL_DIR)/config.json: $(STAMP)
	$(BIN)/rlsys make-tiny-model $(MODEL_DIR)

quickstart: $(MODEL_DIR)/config.json
	$(BIN)/rlsys train configs/quickstart.yaml

# The browser test drives Debian's chromium; install it when missing (needs root, as on CI).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null) || echo "rlsys: could not install chromium"

test: install chromium
	$(BIN)/python -m pytest -q --durations=15 tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache
