"""Suite-wide collection rules.

``tests/vllm/`` runs only inside the vLLM 0.33.0 reference venv (``make test-vllm`` sets
``KVGEOM_VLLM_TESTS=1``): those tests compare kvgeom with vLLM's own functions, which the main venv does
not have. They are not skipped there; they belong to the other command.
"""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("KVGEOM_VLLM_TESTS") == "1" else ["vllm"]
