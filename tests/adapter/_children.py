"""Small child programs for the ProcGroup tests (module-level so ``spawn`` can import them)."""

from __future__ import annotations

import os
import signal
import time


def add(a, b):
    return a + b


def boom(msg):
    raise ValueError(msg)


def die_hard():
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_forever():
    while True:
        time.sleep(0.1)


def ignore_sigterm_and_sleep(ready=None):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ready is not None:
        ready.put("ignoring SIGTERM")
    while True:
        time.sleep(0.1)


def unpicklable():
    return lambda: None


def echo_queue(q):
    q.put(("child", "hello", os.getpid()))
    return "sent"
