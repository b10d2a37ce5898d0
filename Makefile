# moebench - two commands on a fresh machine with Python 3.11:
#   make all    create .venv, install, then env-check, every variant's chapter preset, the parity
#               suite and the report: did the chapter reproduce? (about 5 minutes on 2 CPU cores)
#   make test   install if needed, run the default test suite
#   make gpu-check PYTHON=... FASTMOE_SRC=... WHEELS=...   on a CUDA machine (README: On a CUDA machine)
#
# Torch is always installed pinned (== a version, @ a URL, or a wheel file). Override the pin or
# where torch comes from, never drop it; TORCH_PIP_ARGS applies to the torch install only:
#   make all TORCH_SPEC="torch==2.13.0" TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
#
# Every other dependency is installed at the versions in moebench/constraints.txt (reproducible installs;
# `moebench env-check` warns when the venv drifts from them). CONSTRAINTS= (empty) installs unconstrained,
# CONSTRAINTS=path uses another constraints file.
# Extras installed: test, and the libraries the default suite verifies (verify-parity --library); NeMo Automodel and
# torchtitan with pip's --no-deps from moebench/frameworks.txt (their declared dependencies clash with the pins).
PYTHON         ?= python3
VENV           ?= .venv
TORCH_SPEC     ?= torch==2.13.0
TORCH_PIP_ARGS ?=
CONSTRAINTS    ?= moebench/constraints.txt
PYTEST_ARGS    ?=
# make test runs the default tier in this many pytest processes (pytest-xdist; 0: one process). 2 keeps a
# 2-core machine busy: a test mostly waits on the rank processes it starts, and those start 2-4 each.
TEST_WORKERS   ?= 2
WORLD_SIZE     ?= 4

BIN := $(VENV)/bin
# One stamp per torch spec (and constraints file): changing TORCH_SPEC reinstalls torch into the same .venv.
STAMP := $(VENV)/.moebench-installed-$(shell printf '%s %s %s' '$(TORCH_SPEC)' '$(TORCH_PIP_ARGS)' '$(CONSTRAINTS)' \
	| cksum | cut -d' ' -f1)

.PHONY: all install lint test test-all env-check run-all verify-parity report clean gpu-check

# The steps run in order; a failing step does not stop the later ones (the report says what failed),
# but `make all` exits non-zero when any did. The report reads only the runs this `make all` made.
all: install
	@failed=""; since=$$(date +%Y%m%d-%H%M%S); \
	step() { label="$$1"; shift; echo "== $$label: $$*"; t0=$$(date +%s); "$$@"; rc=$$?; \
		echo "== $$label: exit $$rc after $$(( $$(date +%s) - t0 )) s"; \
		if [ $$rc -ne 0 ]; then failed="$$failed, $$label (exit $$rc)"; fi; }; \
	step env-check $(BIN)/moebench env-check; \
	for v in $$($(BIN)/moebench run --list); do step "run $$v" $(BIN)/moebench run $$v --preset chapter; done; \
	step verify-parity $(BIN)/moebench verify-parity --world-size $(WORLD_SIZE); \
	step report $(BIN)/moebench report --since $$since; \
	if [ -n "$$failed" ]; then echo "make all: failed steps: $${failed#, }"; exit 1; fi

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS) moebench/frameworks.txt
	@case "$(TORCH_SPEC)" in *==*|*@*|*.whl) ;; *) echo "TORCH_SPEC must pin torch (torch==X.Y.Z, torch @ URL or a .whl), got '$(TORCH_SPEC)'"; exit 2;; esac
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test,fast,fairscale,transformers,autoep,automodel,torchtitan,megatron]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	$(BIN)/pip install --quiet --no-deps -r moebench/frameworks.txt $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	@rm -f $(VENV)/.moebench-installed-*
	@touch $(STAMP)

test: install lint
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check moebench tests
	$(BIN)/lint-imports --no-cache  # the layers and the library packages' independence (pyproject.toml)

# Every tier, each command in a fresh interpreter (the default tier forks most from a warm one: tests/helpers/warmcli.py).
test-all: install
	MOEBENCH_TEST_FRESH_CLI=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

env-check: install
	$(BIN)/moebench env-check

# Every registered variant with its quick preset (the registry is the single list): a smoke run
# of seconds. Named explicitly: the variants' defaults differ (fastmoe quick, deepspeed chapter).
run-all: install
	@for v in $$($(BIN)/moebench run --list); do \
		echo "== moebench run $$v --preset quick"; $(BIN)/moebench run $$v --preset quick || exit $$?; done

verify-parity: install
	$(BIN)/moebench verify-parity --world-size $(WORLD_SIZE)

report: install
	$(BIN)/moebench report

clean:
	rm -rf $(VENV) .pytest_cache

# ---------------------------------------------------------------- on a CUDA machine (docs/gpu.md)
# make gpu-check PYTHON=/path/to/python FASTMOE_SRC=~/fastmoe WHEELS=~/wheels
#   PYTHON       the interpreter whose torch is a CUDA build (the machine's own; never replaced)
#   GPU_VENV     a venv that sees PYTHON's packages, its torch (default .venv-gpu); empty: install
#                moebench's missing dependencies into PYTHON's own environment
#   WHEELS       offline: a wheel folder (scripts/gpu-wheels.sh makes one); pip --no-index
#   FASTMOE_SRC  a fastmoe source tree to build (never downloaded); else an installed fmoe
# First, with nothing created: no CUDA GPU is one line ("no CUDA GPU: ...") and exit 2.
GPU_VENV        ?= .venv-gpu
WHEELS          ?=
FASTMOE_SRC     ?=
GPU_CONSTRAINTS ?= $(CONSTRAINTS)
GPU_CHECK_ARGS  ?=
GPU_PY = $(if $(GPU_VENV),$(GPU_VENV)/bin/python,$(PYTHON))
GPU_PREFLIGHT = PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$(CURDIR) $(PYTHON) -m moebench.gpucheck.preflight

gpu-check:
	$(eval GPU_SEEN := $(shell $(GPU_PREFLIGHT) --make 2>/dev/null))
	$(if $(filter ok,$(firstword $(GPU_SEEN))),,$(error $(or $(GPU_SEEN),no CUDA GPU: PYTHON=$(PYTHON) does not run)))
	@PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$(CURDIR) $(PYTHON) -m moebench.gpucheck.install --python $(PYTHON) \
		--venv '$(GPU_VENV)' --wheels '$(WHEELS)' --constraints '$(GPU_CONSTRAINTS)'
	@rc=0; $(GPU_PY) -m moebench gpu-check $(if $(FASTMOE_SRC),--fastmoe-src '$(FASTMOE_SRC)') $(GPU_CHECK_ARGS) \
		|| rc=$$?; $(GPU_PY) -m moebench report || true; exit $$rc
