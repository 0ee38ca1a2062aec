"""kvgeom: KV-cache and SSM-state transfer geometry for disaggregated (P/D) LLM serving."""

from .errors import *  # noqa: F401,F403

__version__ = "0.1.0"
