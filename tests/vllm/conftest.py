"""Set-up of the tests that run kvgeom against vLLM 0.33.0's own functions (collected only with
``KVGEOM_VLLM_TESTS=1``, see ``tests/conftest.py``).

vLLM is imported in CPU mode, offline, with the DS conv-state layout its Mamba transfer needs; the
variables are set here before any test module imports it. The hypothesis profile is derandomized (the
same examples every run, as CI needs) and keeps no example database.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

for key, value in (
    ("VLLM_TARGET_DEVICE", "cpu"),
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("VLLM_SSM_CONV_STATE_LAYOUT", "DS"),
):
    os.environ.setdefault(key, value)

settings.register_profile(
    "vllm-differential",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
settings.load_profile("vllm-differential")
