"""vLLM 0.33.0's own geometry steps that only the vLLM connector (``kvgeom_vllm``) asks for: its
handshake checks on advertised numbers without cards (``advertised``), and its region discovery from
cache tensors (``registration``)."""
