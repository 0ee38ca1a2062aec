"""ProcGroup (child results as data, bounded teardown) and TransportConfig. No NIXL needed."""

from __future__ import annotations

import dataclasses
import time

import pytest
from _children import add, boom, die_hard, echo_queue, ignore_sigterm_and_sleep, sleep_forever, unpicklable
from kvgeom_lab import ChildFailed, ProcGroup
from kvgeom_nixl import TransportConfig


def test_results_errors_deaths_and_timeouts_come_back_as_data():
    with ProcGroup(term_grace_s=0.5, join_timeout_s=2.0) as g:
        g.start([(add, (2, 3), "add"), (boom, ("bad input",), "boom"), (die_hard, (), "killed")])
        g.spawn(sleep_forever, (), "sleeper")
        g.spawn(unpicklable, (), "lambda")
        t0 = time.monotonic()
        res = g.collect(timeout_s=60.0, names=["add", "boom", "killed", "lambda"])
        # did not wait for the dead child until the deadline (a generous one: on a loaded machine starting
        # the five children alone took over 6 s)
        assert time.monotonic() - t0 < 30.0
        late = g.collect(timeout_s=0.3, names=["sleeper"])
        procs = list(g.procs.values())
    assert res["add"].ok and res["add"].value == 5 and res["add"].unwrap() == 5
    b = res["boom"]
    assert not b.ok and b.error == "ValueError('bad input')" and b.error_type == "builtins.ValueError"
    assert "raise ValueError(msg)" in b.traceback
    with pytest.raises(ChildFailed, match="bad input"):
        b.unwrap()
    assert not res["killed"].ok and res["killed"].exitcode == -9
    assert not res["lambda"].ok and "cannot send result" in res["lambda"].error
    assert not late["sleeper"].ok and "still running" in late["sleeper"].error
    assert all(not p.is_alive() for p in procs)  # the group ended the sleeper


def test_survivors_are_killed_even_if_they_ignore_sigterm_and_on_exception():
    with pytest.raises(RuntimeError, match="test body failed"):
        with ProcGroup(term_grace_s=0.3, join_timeout_s=2.0) as g:
            ready = g.queue()
            p = g.spawn(ignore_sigterm_and_sleep, (ready,), "stubborn")
            assert (
                ready.get(timeout=60) == "ignoring SIGTERM"
            )  # its handler is in place (slow on a busy machine)
            raise RuntimeError("test body failed")
    assert not p.is_alive() and p.exitcode == -9


def test_coordination_queue_and_duplicate_names():
    with ProcGroup() as g:
        q = g.queue()
        g.spawn(echo_queue, (q,), "echo")
        who, ev, pid = q.get(timeout=10)
        assert (who, ev, pid) == ("child", "hello", g.procs["echo"].pid)
        assert g.collect(10)["echo"].value == "sent"
        with pytest.raises(ValueError):
            g.spawn(add, (1, 2), "echo")


def test_config_defaults_validation_and_env():
    c = TransportConfig()
    assert c.backends == ("UCX",) and c.progress_thread is False and c.telemetry is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.progress_thread = True  # type: ignore[misc]
    assert TransportConfig(backends=["UCX", "GDS"]).backends == ("UCX", "GDS")
    assert TransportConfig(backends="UCX").backends == ("UCX",)
    for bad in (
        {"backends": ()},
        {"transfer_timeout_s": 0},
        {"poll_interval_s": -1},
        {"notif_timeout_s": float("nan")},
    ):
        with pytest.raises(ValueError):
            TransportConfig(**bad)
    env = {
        "KVGEOM_NIXL_BACKENDS": "UCX, POSIX",
        "KVGEOM_NIXL_PROGRESS_THREAD": "yes",
        "KVGEOM_NIXL_TRANSFER_TIMEOUT_S": "2.5",
        "OTHER": "x",
    }
    c = TransportConfig.from_env(env, telemetry=False)
    assert (c.backends, c.progress_thread, c.transfer_timeout_s, c.telemetry) == (
        ("UCX", "POSIX"),
        True,
        2.5,
        False,
    )
    with pytest.raises(ValueError, match="PROGRESS_THREAD"):
        TransportConfig.from_env({"KVGEOM_NIXL_PROGRESS_THREAD": "maybe"})
    with pytest.raises(ValueError, match="TIMEOUT"):
        TransportConfig.from_env({"KVGEOM_NIXL_HANDSHAKE_TIMEOUT_S": "soon"})


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("max_pending", 0),
        ("max_pending", -5),
        ("max_pending", 1 << 17),
        ("max_pending", 2.5),
        ("max_pending", True),
        ("preamble_timeout_s", 0),
        ("preamble_timeout_s", -1.0),
        ("preamble_timeout_s", float("nan")),
        ("preamble_timeout_s", float("inf")),
        ("preamble_timeout_s", 61.0),
        ("preamble_timeout_s", "1"),
    ],
)
def test_side_channel_bounds_are_validated_with_typed_errors(field, bad):
    """``max_pending`` and ``preamble_timeout_s`` (issue 22): a ``ConfigError`` naming the field, the value
    given and the range allowed."""
    from kvgeom.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        TransportConfig(**{field: bad})
    assert e.value.field == field
    assert e.value.values["value"] is bad or e.value.values["value"] != e.value.values["value"]  # nan
    lo, hi = e.value.values["expected"]
    assert lo < hi


def test_side_channel_bounds_defaults_and_env():
    c = TransportConfig()
    assert (c.max_pending, c.preamble_timeout_s) == (512, 1.0)
    env = {"KVGEOM_NIXL_MAX_PENDING": "64", "KVGEOM_NIXL_PREAMBLE_TIMEOUT_S": "0.25"}
    c = TransportConfig.from_env(env)
    assert (c.max_pending, c.preamble_timeout_s) == (64, 0.25)


def test_importing_the_adapter_is_cheap():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    code = "import kvgeom_nixl, sys; print('torch' in sys.modules, 'nixl' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["False", "False"], out.stderr
