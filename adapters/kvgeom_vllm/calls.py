"""Calling kvgeom's answers as vLLM calls them: each call counted in the table's counters, and a kvgeom
refusal raised as an instance of the exception classes vLLM raises at that point.

This module imports neither vLLM nor torch, so that every layer of kvgeom_vllm (the answers, the
handshake, kvgeom mode and the workers) can count its calls without importing the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvgeom.errors import KvgeomError

from .table import CALLS, REFUSED, entry

__all__ = ["as_vllm_error", "counted_call"]

_COMPAT_CLASSES: dict[tuple[type, ...], type] = {}
_BUILTIN_ERRORS = {
    "AssertionError": AssertionError,
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
    "NotImplementedError": NotImplementedError,
    "IndexError": IndexError,
}


def as_vllm_error(exc: KvgeomError, *vllm_classes: type[BaseException]) -> KvgeomError:
    """kvgeom's typed error, also an instance of every class vLLM raises at that point (an assert is an
    ``AssertionError``), so that vLLM's callers catch what they always caught."""
    missing = tuple(c for c in vllm_classes if not isinstance(exc, c))
    # the most specific classes suffice (NotImplementedError is a RuntimeError)
    missing = tuple(c for c in missing if not any(d is not c and issubclass(d, c) for d in missing))
    if not missing:
        return exc
    key = (type(exc), *missing)
    cls = _COMPAT_CLASSES.get(key)
    if cls is None:
        cls = type(type(exc).__name__, (type(exc), *missing), {"__module__": type(exc).__module__})
        _COMPAT_CLASSES[key] = cls
    out = cls.__new__(cls, *exc.args)
    out.__dict__.update(exc.__dict__)
    out.args = exc.args
    return out


def counted_call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the adapter of table row ``name``: count it, translate a refusal to vLLM's exception types."""
    CALLS[name] += 1
    try:
        return fn(*args, **kwargs)
    except KvgeomError as exc:
        REFUSED[name] += 1
        raised = tuple(_BUILTIN_ERRORS[n] for n in entry(name).raises)
        raise as_vllm_error(exc, *raised).with_traceback(exc.__traceback__) from None
