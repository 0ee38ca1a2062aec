#!/usr/bin/env bash
# make test-core: kvgeom's own suite as two pytest processes side by side (docs/testing.md, "Two processes").
#
#   processes: tests/adapter, tests/transport, tests/mooncake -- real NIXL agents and Mooncake engines in
#              separate processes, network namespaces, etcd; most of their time is spent waiting on
#              deadlines and child processes (under stress-ng --cpu 2 they take ~1.2x their idle time).
#   cpu:       everything else (tests/unit, tests/property, tests/testing, tests/golden): pure CPU.
#
# Run together they overlap that waiting with the CPU-bound half (measured idle on 2 cores: 639 s + 52 s +
# 17 s against 618 s when run one after the other). The two share nothing a test starts (no port, file or
# namespace of the cpu half is used by the other); each is its own interpreter, so PYTHONFAULTHANDLER and
# the clean-exit check hold per process. The cpu half's output is buffered in a file and printed after the
# processes half finishes (its own order kept); the exit status is non-zero if either half failed.
# Arguments go to both pytest processes (for example -x or -k).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PROCESSES=(tests/adapter tests/transport tests/mooncake)
ignore=()
for d in "${PROCESSES[@]}"; do ignore+=("--ignore=$d"); done
log=$(mktemp "${TMPDIR:-/tmp}/kvgeom-test-core.XXXXXX")
trap 'rm -f "$log"; [ -n "${cpu_pid:-}" ] && kill "$cpu_pid" 2>/dev/null' EXIT
t0=$SECONDS
export PYTHONFAULTHANDLER=1
"$PY" -m pytest "${ignore[@]}" "$@" >"$log" 2>&1 &
cpu_pid=$!
echo "== test-core: processes half (${PROCESSES[*]}); the cpu half runs beside it (pid $cpu_pid)"
"$PY" -m pytest "${PROCESSES[@]}" "$@"
proc_rc=$?
proc_s=$((SECONDS - t0))
wait "$cpu_pid"
cpu_rc=$?
cpu_pid=
echo "== test-core: cpu half (tests less ${PROCESSES[*]})"
cat "$log"
echo "test-core: processes half exit $proc_rc in ${proc_s}s, cpu half exit $cpu_rc; $((SECONDS - t0))s wall"
[ "$proc_rc" = 0 ] && [ "$cpu_rc" = 0 ]
