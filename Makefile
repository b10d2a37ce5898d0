# moebench - two commands on a fresh machine with Python 3.11:
#   make all    create .venv, install, run every experiment and the parity suite
#   make test   install if needed, run the default test suite
#
# Torch is always installed pinned. Override the pin for another build, e.g. a CUDA wheel:
#   make all TORCH_SPEC="torch==2.13.0" PIP_EXTRA="--index-url https://<your-torch-index>"
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PIP_EXTRA   ?=
PYTEST_ARGS ?=
WORLD_SIZE  ?= 4

BIN := $(VENV)/bin
STAMP := $(VENV)/.moebench-installed

.PHONY: all install test test-all env-check run-all verify-parity clean

all: install env-check run-all verify-parity

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@case "$(TORCH_SPEC)" in *[=\<\>~@/]*) ;; *) echo "TORCH_SPEC must pin a version (e.g. torch==2.13.0), got '$(TORCH_SPEC)'"; exit 2;; esac
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet $(PIP_EXTRA) -e '.[test]'
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

env-check: install
	$(BIN)/moebench env-check

# Every registered variant with its default preset (the registry is the single list).
run-all: install
	@for v in $$($(BIN)/moebench run --list-names); do \
		echo "== moebench run $$v"; $(BIN)/moebench run $$v || exit $$?; done

verify-parity: install
	$(BIN)/moebench verify-parity --world-size $(WORLD_SIZE)

clean:
	rm -rf $(VENV) .pytest_cache
