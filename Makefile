# The README's two commands: `make demo` runs the main job, `make test` passes the tests.
# Each sets up .venv itself. TORCH pins the torch build: the default takes the CPU
# wheel on this kind of machine; with GPUs, e.g. `make demo TORCH="torch==2.13.0"`
# from the CUDA index, or TORCH= to keep the torch already in the venv.
PYTHON ?= python3
TORCH ?= torch==2.13.0
EXTRAS ?= dev,report,docs
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH) $(EXTRAS)' | cksum | cut -d' ' -f1)

.PHONY: demo test test-quick mutate lint setup clean bench docs docs-serve cluster-deps

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH)" ]; then $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Three pytest workers (pytest-xdist) on 2 cores: the end-to-end tests and the cluster tier mostly wait on process
# start-up, SLURM and deadlines, and two workers left the cores 30% idle (make test on this 2-core VM, quiet,
# 2026-11-29: -n 2 987 s at 140% CPU; -n 3 887 s at 158%, later 824-896 s; -n 4 slower still, with two load-sensitive
# failures). TEST_WORKERS=0 runs everything in one process. Each test file is one unit
# of work (--dist loadscope: a module's fixtures are made once), the cluster tier's files together as one (one
# virtual SLURM, on one worker), handed out longest first (tests/conftest.py orders them by tests/durations.json;
# `pytest --record-durations` writes it). Hypothesis runs the same
# examples every time (its "ci" profile, tests/conftest.py); the fault tests' random draws print their seed in
# the header: FAULT_SEED=N draws them again.
TEST_WORKERS ?= 3
FAULT_SEED ?=
TEST_FLAGS := --hypothesis-profile=ci $(if $(FAULT_SEED),--fault-seed $(FAULT_SEED))
XDIST := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
test: $(STAMP) cluster-deps
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(TEST_FLAGS)

# The cluster tier (tests/cluster) runs a real SLURM on virtual hosts of this machine: Debian's daemons, installed
# here where the tests run as root with apt (CI does); elsewhere the tier says in one line why it did not run.
CLUSTER_PACKAGES := slurmctld slurmd slurm-client munge iproute2
cluster-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v slurmctld >/dev/null 2>&1; then \
	  echo "installing the cluster tier's packages: $(CLUSTER_PACKAGES)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CLUSTER_PACKAGES)) >/dev/null 2>&1 \
	    || echo "could not install them: the cluster tier will say why it did not run"; \
	fi

# The pure tier (docs/testing.md): tests/unit and tests/fakecuda, without what spawns ranks, runs the command line
# end to end or is marked slow.
test-quick: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(TEST_FLAGS) -m "not dist and not e2e and not slow" tests/unit tests/fakecuda

# Mutation testing of the modules whose rules guard data (docs/testing.md): each mutant against the fast tests that
# call its function, from a fresh mutants/ copy, niced (a shared machine); prints the score per module and every
# survivor, and fails below 90% in any module. Not part of `make test` (about 15 minutes on 2 cores).
mutate: $(STAMP)
	rm -rf mutants
	nice -n 10 $(PY) tools/mutate.py

# Every side-by-side benchmark in quick mode (takes /tmp/multigpu-bench.lock itself), into one JSON;
# then the Markdown table and the generated block of benchmarks/RESULTS.md are rendered from it.
bench: $(STAMP)
	$(PY) benchmarks/run_all.py --out benchmarks/results/bench.json; rc=$$?; \
	$(PY) benchmarks/render.py benchmarks/results/bench.json --results benchmarks/RESULTS.md && exit $$rc

# The docs site, offline and strict (a broken link or anchor, a page left out of the nav, a warning: it fails),
# into site/. Its reference pages are generated from the code at every build (docs/hooks/reference.py), so
# this one command also regenerates them; `make test` builds it the same way and runs its examples.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs
docs: $(STAMP)
	$(MKDOCS) build --strict

docs-serve: $(STAMP)
	$(MKDOCS) serve --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks docs tools

clean:
	rm -rf $(VENV) build site mutants *.egg-info src/*.egg-info
