"""Hypothesis profiles of the property tests, chosen with ``KVGEOM_HYPOTHESIS_PROFILE`` (default ``ci``).

* ``ci``: 1,500 examples per property test (5 tests: 7,500 in all, about 100 s on a 2-core machine),
  derandomized so CI is reproducible;
* ``long``: 5,000 per test (25,000 in all), randomized, for a nightly or local soak;
* ``dev``: 50 per test, for a quick local run;
* ``mutate``: 30 per test, derandomized, for ``make mutate`` (each mutant reruns the tests that reach it).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], print_blob=True
)

settings.register_profile("ci", max_examples=1500, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=5000, **_COMMON)
settings.register_profile("dev", max_examples=50, **_COMMON)
settings.register_profile("mutate", max_examples=30, derandomize=True, database=None, **_COMMON)
settings.load_profile(os.environ.get("KVGEOM_HYPOTHESIS_PROFILE", "ci"))
