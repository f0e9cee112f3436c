# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make demo`: the runtime and the emulator's plotting only, none of the test tools
DEMO_STAMP := $(VENV)/.installed-demo
# promtool, prometheus, systemd-analyze, logrotate, chromium for the deployment and status-page tests (scripts/tools.sh says how)
TOOLS := .tools/bin/.installed
# pytest-xdist workers for `make test` (the suite is mostly waiting on real servers; 2 fits CI's 2 cores)
TEST_JOBS ?= 2

.PHONY: demo test lint venv tools clean bench-overhead bench-floor-variants bench-admission mutation soak fuzz

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[emulator]'
	touch $(DEMO_STAMP)

venv: $(DEMO_STAMP)

$(TOOLS): scripts/tools.sh tests/crd/package-lock.json
	bash scripts/tools.sh
	touch $(TOOLS)

tools: $(TOOLS)

demo: $(DEMO_STAMP)
	$(BIN)/sglang-sidecar demo

test: $(STAMP) $(TOOLS)
	$(BIN)/ruff check sidecar sidecar_emulator tests bench grafana
	$(BIN)/python -m pytest -q -n $(TEST_JOBS)

# Proxy overhead against nginx and direct (bench/overhead.py); ARGS="--quick" for a run of about four minutes (three saturation rounds).
# nginx and wrk come from Debian's packages, extracted into .tools/ when they are not installed.
bench-overhead: $(STAMP)
	$(BIN)/python bench/overhead.py $(ARGS)

# Where the floor's CPU goes (bench/floor_variants.py): its relay with the server, the client or the chunk
# relay replaced by a minimal asyncio Protocol + httptools, against nginx; ARGS="--quick", "--profile".
bench-floor-variants: $(STAMP)
	$(BIN)/python bench/floor_variants.py $(ARGS)

# Mutation testing of the admission core (sidecar/core/, admission/, intake/demand.py, policy/schema.py): about 20 minutes on
# 2 cores. MUTATION.md lists every surviving mutant and why it is equivalent; scripts/mutation_score.py
# fails below 90 % or on a survivor it does not list.
mutation: $(STAMP)
	rm -rf mutants
	$(BIN)/mutmut run --max-children 2
	$(BIN)/python scripts/mutation_score.py

lint: $(STAMP)
	$(BIN)/ruff check sidecar sidecar_emulator tests bench grafana
	$(BIN)/ruff format --check sidecar sidecar_emulator tests bench grafana

clean:
	rm -rf $(VENV) .tools .pytest_cache build *.egg-info

# Admission quality against peers' rules and an oracle (bench/admission.py); ARGS="--quick" for < 3 min.
bench-admission: $(STAMP)
	$(BIN)/python bench/admission.py $(ARGS)

# 300 clients through the sidecar against the emulator for 10 minutes (tests/test_soak.py runs 60 s).
soak: $(STAMP)
	$(BIN)/python -m bench.soak --duration-s $${SOAK_S:-600}

# The fuzz tests (tests/test_fuzz.py) with many more examples than `make test` runs: ~10 minutes here.
fuzz: $(STAMP)
	SIDECAR_FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-2000} $(BIN)/python -m pytest -q tests/test_fuzz.py tests/test_admin_schema.py
