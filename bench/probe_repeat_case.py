"""Run one test case many times, optionally with the cores kept busy, and count how often it fails.

How docs/reliability.md measured the READ that stayed ``PROC`` (3 of 38 runs under the heavy mix):

    .venv/bin/python bench/probe_repeat_case.py --runs 20 --stress "--cpu 4 --vm 2 --vm-bytes 1G --io 2" \\
        "tests/transport/test_transport_e2e.py::test_producer_stalled_past_the_deadline_is_fenced_until_gone[nixl]"

Each run is a fresh pytest process (bounded by ``--timeout``); its output is kept under ``--logs``. The
load, if any, is one ``stress-ng`` process for the whole loop, ended when the loop ends.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case", help="a pytest node id")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--stress", default="", help='stress-ng arguments, e.g. "--cpu 2"; empty: no load')
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--logs", default="/tmp/kvgeom-repeat", help="where each run's output goes")
    args = ap.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    load = None
    if args.stress:
        if shutil.which("stress-ng") is None:
            print("--stress needs stress-ng (as root: make host-deps)", file=sys.stderr)
            return 2
        load = subprocess.Popen(["stress-ng", "--quiet", "--timeout", "7200s", *shlex.split(args.stress)])
    failed = 0
    try:
        for i in range(1, args.runs + 1):
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:randomly",
                "-p",
                "no:cacheprovider",
                "-q",
                args.case,
            ]
            t0 = time.monotonic()
            with open(logs / f"run-{i}.log", "w") as out:
                try:
                    rc = subprocess.run(
                        cmd, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout
                    ).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
            failed += rc != 0
            print(f"run {i}: rc {rc}, {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        if load is not None:
            load.terminate()
            load.wait(timeout=30)
    print(f"{args.runs - failed} of {args.runs} passed; logs in {logs}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
