"""vLLM 0.33.0's NIXL workers with every geometry step answered by kvgeom.

The classes here subclass vLLM's own (``NixlPullConnectorWorker``, ``NixlPushConnectorWorker``,
``TransferTopology``, ``MambaConvSplitInfo``); their geometry methods are the adapters of
:mod:`kvgeom_vllm.answers`, installed from :data:`kvgeom_vllm.table.TABLE` and counted. vLLM's threads,
agents, side channel, scheduler and completion tracking run unchanged.

Two of vLLM's geometry functions are module functions its worker calls by name
(``compute_tp_mapping`` in ``add_remote_agent``, ``derive_mamba_conv_split`` in ``__init__``).
:func:`install_dispatchers` replaces them in vLLM's ``base_worker`` module by dispatchers that send the
calls of kvgeom workers (recognised by their :class:`KvgeomTransferTopology`) to kvgeom and every other
call to vLLM's function, so a plain ``NixlConnector`` in the same process keeps vLLM's behaviour.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from kvgeom.errors import KvgeomError

from . import answers
from .table import CALLS, REFUSED, TABLE, Entry, entry

__all__ = [
    "KvgeomTransferTopology", "KvgeomBaseWorker", "KvgeomPullConnectorWorker", "KvgeomPushConnectorWorker",
    "KvgeomConvSplitInfo", "counted", "counted_call", "install_dispatchers", "as_vllm_error",
]

_COMPAT_CLASSES: dict[tuple[type, type], type] = {}
_BUILTIN_ERRORS = {"AssertionError": AssertionError, "ValueError": ValueError, "RuntimeError": RuntimeError,
                   "NotImplementedError": NotImplementedError}


def as_vllm_error(exc: KvgeomError, vllm_cls: type[BaseException]) -> KvgeomError:
    """kvgeom's typed error, also an instance of the class vLLM raises at that point (an assert is an
    ``AssertionError``), so that vLLM's callers catch what they always caught."""
    if isinstance(exc, vllm_cls):
        return exc
    key = (type(exc), vllm_cls)
    cls = _COMPAT_CLASSES.get(key)
    if cls is None:
        cls = type(type(exc).__name__, (type(exc), vllm_cls), {"__module__": type(exc).__module__})
        _COMPAT_CLASSES[key] = cls
    out = cls.__new__(cls, *exc.args)
    out.__dict__.update(exc.__dict__)
    out.args = exc.args
    return out


def counted_call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the adapter of table row ``name``: count it, translate a refusal to vLLM's exception type."""
    CALLS[name] += 1
    try:
        return fn(*args, **kwargs)
    except KvgeomError as exc:
        REFUSED[name] += 1
        raise as_vllm_error(exc, _BUILTIN_ERRORS[entry(name).raises]).with_traceback(exc.__traceback__) from None


def counted(e: Entry) -> Callable[..., Any]:
    """The adapter of row ``e``, counted (what gets installed in vLLM's place)."""
    fn = getattr(answers, e.answer)  # type: ignore[arg-type]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return counted_call(e.qualname, fn, *args, **kwargs)

    wrapper.__kvgeom_entry__ = e  # type: ignore[attr-defined]
    return wrapper


def _install_methods(cls: type, owner: str) -> type:
    """Set every answered method of ``owner`` (a vLLM class name in the table) on ``cls``."""
    for e in TABLE:
        if e.answer is not None and e.owner == owner and e.answer in vars(answers):
            setattr(cls, e.attr, counted(e))
    return cls


def _vllm_classes() -> Any:
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, pull_worker, push_worker

    return utils.TransferTopology, base_worker.NixlBaseConnectorWorker, pull_worker.NixlPullConnectorWorker, \
        push_worker.NixlPushConnectorWorker


_TransferTopology, _BaseWorker, _PullWorker, _PushWorker = _vllm_classes()
KvgeomConvSplitInfo = answers.KvgeomConvSplitInfo


class KvgeomTransferTopology(_TransferTopology):
    """vLLM's ``TransferTopology`` whose TP arithmetic is kvgeom's."""


_install_methods(KvgeomTransferTopology, "TransferTopology")


class KvgeomWorkerMixin:
    """The geometry methods of vLLM's NIXL worker, answered by kvgeom (installed from the table), plus
    what makes vLLM's own methods reach kvgeom: the conv split in ``__init__`` and the topology class."""

    #: "vllm" (default): refuse what vLLM 0.33.0 refuses; "kvgeom": let kvgeom decide (see handshake.py)
    kvgeom_compat: str = "vllm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "_conv_decomp", None) is not None:
            # vLLM derived it by name inside its __init__; the kvgeom answer replaces it.
            spec = next(s for s in self._layer_specs.values() if isinstance(s, answers._KVI.MambaSpec)
                        and (not self._is_csa_linear or not s.tp_replicated))
            self._conv_decomp = counted_call("derive_mamba_conv_split", answers.derive_mamba_conv_split, spec,
                                             self.vllm_config.parallel_config.tensor_parallel_size)
            self._mamba_ssm_size = self._conv_decomp.ssm_sizes

    def _kvgeom_topology(self) -> None:
        topo = getattr(self, "transfer_topo", None)
        if topo is not None and type(topo) is _TransferTopology:
            topo.__class__ = KvgeomTransferTopology


_install_methods(KvgeomWorkerMixin, "NixlBaseConnectorWorker")


def _with_handshake(cls: type) -> type:
    from . import handshake

    cls.register_kv_caches = handshake.register_kv_caches_wrapper(cls.register_kv_caches)
    cls.add_remote_agent = handshake.add_remote_agent_wrapper(cls.add_remote_agent)
    return cls


@_with_handshake
class KvgeomBaseWorker(KvgeomWorkerMixin, _BaseWorker):
    """vLLM's base NIXL worker with kvgeom geometry."""


@_with_handshake
class KvgeomPullConnectorWorker(KvgeomWorkerMixin, _PullWorker):
    """vLLM's pull (READ) NIXL worker with kvgeom geometry."""


@_with_handshake
class KvgeomPushConnectorWorker(KvgeomWorkerMixin, _PushWorker):
    """vLLM's push (WRITE) NIXL worker with kvgeom geometry."""


# -- dispatchers for the module functions vLLM's worker calls by name ---------------------------------------
_DISPATCH_LOCK = threading.Lock()
_DISPATCHED = False
#: the dispatchers installed in vLLM's modules, by table row (the test plugin replaces them outright)
DISPATCHERS: dict[str, Callable[..., Any]] = {}


def install_dispatchers() -> None:
    """Route ``base_worker.compute_tp_mapping`` calls made with a :class:`KvgeomTransferTopology` to
    kvgeom; every other call keeps vLLM's function. Idempotent."""
    global _DISPATCHED
    with _DISPATCH_LOCK:
        if _DISPATCHED:
            return
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

        original = base_worker.compute_tp_mapping
        kvgeom_fn = counted(entry("compute_tp_mapping"))

        @functools.wraps(original)
        def compute_tp_mapping(transfer_topology: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(transfer_topology, KvgeomTransferTopology):
                return kvgeom_fn(transfer_topology, *args, **kwargs)
            return original(transfer_topology, *args, **kwargs)

        base_worker.compute_tp_mapping = compute_tp_mapping
        DISPATCHERS["compute_tp_mapping"] = compute_tp_mapping
        # The handshake decodes peers' metadata with this name: the subclass keeps their card (a plain vLLM
        # worker ignores the field, and reads None from a plain peer).
        from .handshake import KvgeomAgentMetadata, _PlainAgentMetadata

        if base_worker.NixlAgentMetadata is _PlainAgentMetadata:
            base_worker.NixlAgentMetadata = KvgeomAgentMetadata
        _DISPATCHED = True


install_dispatchers()
