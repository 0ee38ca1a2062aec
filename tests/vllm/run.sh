#!/usr/bin/env bash
# make test-vllm: vLLM 0.33.0's own NIXL connector tests run through kvgeom's integration (kvgeom_vllm),
# then kvgeom's tests that need vLLM (tests/vllm, KVGEOM_VLLM_TESTS=1).
#
# Stages (each skipped when its stamp is newer than its inputs, so a second run only runs the tests):
#   1. .venv-vllm: an isolated venv with vLLM 0.33.0 installed WITHOUT its dependencies (they would pull
#      CUDA), torch pinned to the CPU build by constraints-dev.txt, the light dependencies vLLM's import chain
#      needs (explicit list below), pytest, and kvgeom itself (editable).
#   2. .vllm-src/: vLLM's own tests, taken from vLLM's source package (the wheel has none). pip downloads the
#      sdist; its metadata step needs vLLM's build requirements: torch comes from .venv-vllm, the rest is
#      installed into a throw-away folder (pip --target) put on PYTHONPATH and removed afterwards.
#      Only tests/ and pyproject.toml are unpacked; nothing of it is committed (.gitignore).
#
# Disk: CI machines can be short of it, so pip keeps no cache (--no-cache-dir), no second torch is installed
# for the metadata step, and xgrammar comes without triton (1 GB; vLLM's CPU path and these tests never use
# it). .venv-vllm is about 2.5 GB, and the set-up needs about 0.3 GB more while it runs.
#   3. .vllm-src/hf: an offline Hugging Face cache holding facebook/opt-125m's config.json (tests/data).
#   4. the tests: vLLM's three NIXL geometry test files with -p kvgeom_vllm.pytest_plugin, vLLM's three Mooncake
#      connector test files with -p kvgeom_vllm.mooncake.pytest_plugin, then tests/vllm (its
#      test_mooncake_engine.py: the connector's worker over Mooncake's real transfer engine, the wheel from stage 1).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=${KVGEOM_VLLM_VENV:-$ROOT/.venv-vllm}
SRC=$ROOT/.vllm-src
VLLM_VERSION=0.33.0
CONSTRAINTS=$ROOT/constraints-dev.txt
PIP_QUIET=${PIP_QUIET:--q}
PIP_FLAGS=($PIP_QUIET --no-cache-dir --no-warn-conflicts)
# The light dependencies of the import chain vLLM's connector tests walk through: vLLM's own requirements
# minus everything CUDA, plus what a bare venv lacks for that chain (cloudpickle, requests, regex, ...).
# Explicit and sufficient for the three test files; not minimised. hypothesis is for tests/vllm's differential
# tests, nixl (CPU-capable, no CUDA) for its end-to-end tests with real NIXL agents.
LIGHT_DEPS=(
  numpy pydantic pytest psutil pyzmq "transformers>=5.16.1,<5.21.0" cbor2 aiohttp openai_harmony openai pillow
  pybase64 cachetools msgspec uvloop prometheus_client "fastapi>=0.133.0,<0.137.0"
  partial-json-parser "llguidance>=1.7.0,<1.8.0" einops cloudpickle requests regex pyyaml sentencepiece
  blake3 py-cpuinfo gguf diskcache lark tiktoken
  hypothesis nixl
  # vLLM's Mooncake connector tests (run through kvgeom_vllm.mooncake): its bootstrap server and client, async tests
  httpx uvicorn pytest-asyncio
  # Mooncake's transfer engine (pyproject's mooncake extra): tests/vllm/test_mooncake_engine.py runs the connector's
  # worker over the real engine (TCP); on Debian it loads once libibverbs1 and librdmacm1 are there (make host-deps)
  "mooncake-transfer-engine-non-cuda>=0.3.13"
  # xgrammar's own requirements but triton (installed --no-deps below):
  "apache-tvm-ffi>=0.1.11" typing-extensions
)
TIMEFORMAT='%R'

stamp_fresh() {  # stamp_fresh STAMP INPUT... : the stamp exists and is newer than every input
  local stamp=$1; shift
  [ -f "$stamp" ] || return 1
  local f; for f in "$@"; do [ "$f" -nt "$stamp" ] && return 1; done
  return 0
}

setup_venv() {
  local stamp=$VENV/.kvgeom-vllm-installed
  stamp_fresh "$stamp" tests/vllm/run.sh "$CONSTRAINTS" pyproject.toml && return 0
  echo "== .venv-vllm: vLLM $VLLM_VERSION without CUDA (isolated venv)"
  # A venv this script made earlier (its stamp is there, older than the inputs) is made afresh, so nothing an
  # older recipe installed (triton, say) stays behind.
  if [ -f "$stamp" ]; then rm -rf "$VENV"; fi
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" -c "$CONSTRAINTS")
  "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" --upgrade pip
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" --no-deps "vllm==$VLLM_VERSION" "xgrammar==0.2.8"
  "${pip[@]}" "${LIGHT_DEPS[@]}"
  "${pip[@]}" --no-deps -e .
  if "$VENV/bin/python" -m pip list 2>/dev/null | grep -i -E '^(nvidia-|triton )'; then
    echo "error: CUDA packages (nvidia-*, triton) were installed into $VENV" >&2; exit 1
  fi
  touch "$stamp"
}

fetch_tests() (  # a subshell: its EXIT trap removes the throw-away build tools, also on failure
  stamp=$SRC/.unpacked-$VLLM_VERSION
  stamp_fresh "$stamp" tests/vllm/run.sh && exit 0
  echo "== .vllm-src: vLLM $VLLM_VERSION's tests from its source package"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # vLLM's build requirements but torch (the venv's own 2.13.0 serves), beside the venv, not in it.
  "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" -c "$CONSTRAINTS" --target "$tmp/tools" cmake ninja \
    packaging "setuptools>=77.0.3,<81" setuptools-rust setuptools-scm wheel jinja2
  # Target "empty": the metadata then lists vLLM's common requirements only (the CPU target's name a wheel by
  # URL, which pip refuses from PyPI). The version override keeps it from naming itself 0.33.0+empty (which
  # pip would reject as not the version asked for).
  PATH=$tmp/tools/bin:$PATH PYTHONPATH=$tmp/tools VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_VERSION \
    "$VENV/bin/python" -m pip download $PIP_QUIET --no-cache-dir --no-deps --no-binary :all: --no-build-isolation \
    "vllm==$VLLM_VERSION" -d "$tmp/sdist"
  rm -rf "$SRC"; mkdir -p "$SRC"
  tar -xzf "$tmp/sdist/vllm-$VLLM_VERSION.tar.gz" -C "$SRC" --strip-components=1 \
    "vllm-$VLLM_VERSION/tests" "vllm-$VLLM_VERSION/pyproject.toml"
  touch "$stamp"
)

setup_hf() {
  local snap=$SRC/hf/hub/models--facebook--opt-125m
  local rev=0000000000000000000000000000000000000000
  mkdir -p "$snap/snapshots/$rev" "$snap/refs"
  cp tests/data/vllm/facebook--opt-125m/config.json "$snap/snapshots/$rev/config.json"
  printf '%s' "$rev" > "$snap/refs/main"
}

# The one test of the three files that needs an accelerator and a model download (it starts a real LLM).
GPU_ONLY="tests/v1/kv_connector/unit/test_nixl_connector_hma.py::test_fewer_blocks_with_hma[google/gemma-3-1b-it-512]"
VLLM_TESTS=(
  tests/v1/kv_connector/unit/test_tp_mapping.py
  tests/v1/kv_connector/unit/test_nixl_desc_geometry.py
  tests/v1/kv_connector/unit/test_nixl_connector_hma.py
)

# vLLM's Mooncake connector tests (its transfer engine mocked by the tests; the wheel is installed for
# tests/vllm/test_mooncake_engine.py, which runs the real one). The two
# deselected ones fail the same way on unmodified vLLM here: they patch the `httpx` module they import, while
# the connector posts through `huggingface_hub.utils.httpx`, so the real client runs and the fake host does not
# resolve. hypothesis' pytest plugin is off for this run: its terminal-summary import of hypothesis trips a
# Python 3.11 AST recursion check after these tests (SystemError), on unmodified vLLM too.
MOONCAKE_TESTS=(
  tests/v1/kv_connector/unit/test_mooncake_connector.py
  tests/v1/kv_connector/unit/test_mooncake_connector_hma.py
  tests/v1/kv_connector/unit/test_mooncake_connector_hybrid_mamba.py
)
MOONCAKE_DESELECT=(
  --deselect tests/v1/kv_connector/unit/test_mooncake_connector.py::test_register_worker_retries_on_read_timeout
  --deselect tests/v1/kv_connector/unit/test_mooncake_connector.py::test_register_worker_raises_after_max_attempts
)

vllm_env() {  # the environment vLLM's CPU code path needs (see docs/vllm.md)
  export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_SSM_CONV_STATE_LAYOUT=DS
  export HF_HOME=$SRC/hf
}

run_vllm_tests() {  # vLLM's own tests, its NIXL geometry replaced by kvgeom_vllm (plugin)
  echo "== vLLM $VLLM_VERSION's NIXL connector tests through kvgeom"
  vllm_env
  (cd "$SRC" && "$VENV/bin/python" -m pytest -p kvgeom_vllm.pytest_plugin \
    --rootdir=. -c pyproject.toml --confcutdir=tests/v1/kv_connector/unit -p no:cacheprovider -q "${VLLM_TESTS[@]}" --deselect "$GPU_ONLY" "$@")
}

run_mooncake_tests() {  # vLLM's own Mooncake connector tests, its geometry replaced by kvgeom_vllm.mooncake
  echo "== vLLM $VLLM_VERSION's Mooncake connector tests through kvgeom"
  vllm_env
  (cd "$SRC" && "$VENV/bin/python" -m pytest -p kvgeom_vllm.mooncake.pytest_plugin -p no:hypothesispytest \
    --rootdir=. -c pyproject.toml --confcutdir=tests/v1/kv_connector/unit -p no:cacheprovider -q \
    "${MOONCAKE_TESTS[@]}" "${MOONCAKE_DESELECT[@]}" "$@")
}

run_vllm_baseline() {  # the same tests on unmodified vLLM (for comparison; not part of make test-vllm)
  vllm_env
  (cd "$SRC" && "$VENV/bin/python" -m pytest --confcutdir=tests/v1/kv_connector/unit -p no:cacheprovider -q \
    "${VLLM_TESTS[@]}" "$@")
}

run_kvgeom_tests() {  # kvgeom's own tests that need vLLM (tests/vllm), in the vLLM venv
  echo "== kvgeom's tests/vllm in the vLLM venv"
  vllm_env
  local rc=0
  KVGEOM_VLLM_TESTS=1 "$VENV/bin/python" -m pytest -p no:cacheprovider tests/vllm "$@" || rc=$?
  if [ "$rc" = 5 ]; then echo "(tests/vllm holds no tests yet)"; rc=0; fi
  return "$rc"
}

setup() {  # the venv, vLLM's tests and the offline model files (make test runs this beside test-core)
  setup_venv
  fetch_tests
  setup_hf
}

all() {
  local t0=$SECONDS
  echo "test-vllm: $(df -Ph . | awk 'NR==2 {print $4}') free on the disk of $ROOT"
  setup_venv
  fetch_tests
  setup_hf
  local t1=$SECONDS
  run_vllm_tests
  run_mooncake_tests
  run_kvgeom_tests
  echo "test-vllm: set-up $((t1 - t0))s, tests $((SECONDS - t1))s"
}

"${@:-all}"
