# kvgeom developer entry points. Every target creates .venv on first use (Python >= 3.10 as python3).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvgeom-installed

.PHONY: demo test test-core test-vllm plan bench lint dist clean venv mutate mutate-ci

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[nixl,dev]'
	@touch $(STAMP)

## The main job: a real NIXL transfer of a Mamba2-hybrid request between P and D processes, verified.
demo: $(STAMP)
	$(PY) -m kvgeom demo

## The whole test suite (what CI runs): kvgeom's own tests, then vLLM's connector tests through kvgeom.
test: test-core test-vllm

test-core: $(STAMP)
	$(PY) -m pytest

## vLLM 0.33.0's own NIXL connector tests run through kvgeom_vllm, in a separate venv (.venv-vllm, vLLM
## without CUDA) with vLLM's tests taken from its source package; then tests/vllm (KVGEOM_VLLM_TESTS=1).
## Fast when .venv-vllm and .vllm-src exist (stamps).
test-vllm:
	PYTHON=$(PYTHON) bash tests/vllm/run.sh

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

bench: $(STAMP)
	$(PY) bench/bench_plan.py
	$(PY) bench/bench_pull.py

## Style and types: ruff's lint rules and formatting, and mypy --strict on the core.
lint: $(STAMP)
	$(PY) -m ruff check kvgeom adapters tests bench
	$(PY) -m ruff format --check kvgeom adapters tests bench
	$(PY) -m mypy --strict kvgeom

## The wheel and the source distribution, in dist/.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

clean:
	rm -rf $(VENV) .venv-vllm .vllm-src mutants .pytest_cache .ruff_cache .hypothesis .mypy_cache build dist *.egg-info
