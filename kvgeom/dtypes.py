"""Element sizes of the dtypes a KV cache or SSM state can hold (torch names)."""

from __future__ import annotations

from kvgeom.errors import SpecError

__all__ = ["DTYPE_BYTES", "dtype_size"]

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_size(name: str, field: str = "dtype") -> int:
    """Bytes per element of the dtype ``name`` (torch spelling, with or without ``torch.``)."""
    key = str(name).removeprefix("torch.")
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        raise SpecError(field, f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}", value=name) from None
