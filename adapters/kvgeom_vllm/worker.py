"""vLLM 0.33.0's NIXL workers and schedulers with every geometry step answered by kvgeom.

The classes here subclass vLLM's own (``NixlPullConnectorWorker``, ``NixlPushConnectorWorker``,
``NixlPull/PushConnectorScheduler``, ``TransferTopology``, ``MambaConvSplitInfo``); their geometry members
are the adapters of :mod:`kvgeom_vllm.answers`, installed from :data:`kvgeom_vllm.table.TABLE` and
counted. vLLM's threads, agents, side channel, scheduler and completion tracking run unchanged.

vLLM's worker calls two geometry functions by module name in code that still runs:
``derive_mamba_conv_split`` (``__init__``) and ``compute_tp_mapping`` (``add_remote_agent`` with a peer
that sends no card);
``_region_sort_key`` is kvgeom's own registration's. :func:`install_dispatchers` replaces the three in
vLLM's ``base_worker`` module by dispatchers that answer with kvgeom while a kvgeom worker runs one of
those methods (a context variable marks it) and with vLLM's function otherwise, so a plain
``NixlConnector`` in the same process keeps vLLM's behaviour.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvgeom.errors import ConfigError

from . import answers, handshake, kvgeom_mode, metadata, plugin
from .calls import as_vllm_error, counted_call
from .table import TABLE, Entry, entry
from .version import profile

__all__ = [
    "KvgeomTransferTopology",
    "KvgeomBaseWorker",
    "KvgeomPullConnectorWorker",
    "KvgeomPushConnectorWorker",
    "KvgeomPullConnectorScheduler",
    "KvgeomPushConnectorScheduler",
    "KvgeomConvSplitInfo",
    "counted",
    "counted_call",
    "install_dispatchers",
    "as_vllm_error",
    "kvgeom_active",
    "agent_settings",
    "progress_delay_of",
    "sync_mode_of",
]


def counted(e: Entry) -> Callable[..., Any]:
    """The adapter of row ``e``, counted (what gets installed in vLLM's place)."""
    fn = getattr(answers, e.answer)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return counted_call(e.qualname, fn, *args, **kwargs)

    wrapper.__kvgeom_entry__ = e  # type: ignore[attr-defined]
    return wrapper


def _install(cls: type, owner: str, base: bool = False) -> type:
    """Set every answered member of ``owner`` (a vLLM class name in the table) on ``cls`` (``base``: the
    members installed below vLLM's pull/push subclasses)."""
    absent = profile().absent  # members the installed vLLM does not have: nothing to replace
    for e in TABLE:
        if e.owner != owner or e.kind in ("wrapper", "attribute", "function") or (e.kind == "base") != base:
            continue
        if e.qualname in absent:
            continue
        fn = counted(e)
        member: Any = {"static": staticmethod, "property": property}.get(e.kind, lambda f: f)(fn)
        setattr(cls, e.attr, member)
    return cls


# -- marking the methods of kvgeom workers, for the module-function dispatchers -----------------------------
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("kvgeom_vllm_active", default=False)


def kvgeom_active() -> bool:
    """Whether the running code is a method of a kvgeom worker (module functions then answer with kvgeom)."""
    return _ACTIVE.get()


@contextmanager
def _active() -> Iterator[None]:
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _marked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _active():
            return method(*args, **kwargs)

    return wrapper


def _vllm_classes() -> Any:
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        base_worker,
        pull_scheduler,
        pull_worker,
        push_scheduler,
        push_worker,
    )

    return (
        utils.TransferTopology,
        base_worker.NixlBaseConnectorWorker,
        pull_worker.NixlPullConnectorWorker,
        push_worker.NixlPushConnectorWorker,
        pull_scheduler.NixlPullConnectorScheduler,
        push_scheduler.NixlPushConnectorScheduler,
    )


_TransferTopology, _BaseWorker, _PullWorker, _PushWorker, _PullScheduler, _PushScheduler = _vllm_classes()
KvgeomConvSplitInfo = answers.KvgeomConvSplitInfo


class KvgeomTransferTopology(_TransferTopology):
    """vLLM's ``TransferTopology`` whose TP, DCP and head arithmetic is kvgeom's."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.local_physical_heads = counted_call(
            f"{_TransferTopology.__name__}.local_physical_heads", answers.topology_local_physical_heads, self
        )


_install(KvgeomTransferTopology, "TransferTopology")


def _check_conv_layout(kv_cache_config: Any) -> None:
    """A typed refusal, before vLLM's own assertion, of a Mamba model whose conv state is not DS."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    specs = [getattr(g, "kv_cache_spec", None) for g in groups]
    inner = [s for spec in specs for s in (getattr(spec, "kv_cache_specs", None) or {}).values()]
    has_mamba = any(isinstance(s, MambaSpec) for s in specs + inner)
    plugin.check_conv_state_layout(has_mamba, is_conv_state_dim_first())


# -- the NIXL agent's progress thread and thread synchronisation ---------------------------------------------
PROGRESS_DELAY_KEY = "nixl_progress_delay_us"
SYNC_MODE_KEY = "nixl_sync_mode"
#: ``kv_connector_extra_config.nixl_sync_mode`` values and the NIXL ``nixl_thread_sync_t`` member each selects
SYNC_MODES = {
    "none": "NIXL_THREAD_SYNC_NONE",
    "strict": "NIXL_THREAD_SYNC_STRICT",
    "rw": "NIXL_THREAD_SYNC_RW",
}
_AGENT_LOCK = threading.Lock()
_LOG = logging.getLogger(__name__)


def _extra(vllm_config: Any, key: str) -> Any:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return ktc.get_from_extra_config(key, None) if ktc is not None else None


def progress_delay_of(vllm_config: Any) -> int | None:
    """``kv_connector_extra_config.nixl_progress_delay_us``: the longest the worker's NIXL progress threads
    wait for an event between two progress calls, in microseconds (``None`` when unset: NIXL's Python API
    gives 0, so they poll without ever sleeping, a core each per engine even when idle). With a delay they
    sleep in ``poll`` on the UCX worker's event descriptor and wake at once for traffic, so a peer's
    connection and reads are still progressed (docs/vllm.md has what was measured)."""
    value = _extra(vllm_config, PROGRESS_DELAY_KEY)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise ConfigError(
            f"kv_connector_extra_config.{PROGRESS_DELAY_KEY}",
            f"must be an integer of microseconds in [0, 1000000], got {value!r}",
            value=value,
            expected="0..1000000",
        )
    return value


def sync_mode_of(vllm_config: Any) -> str | None:
    """``kv_connector_extra_config.nixl_sync_mode``: how the worker's NIXL agent serialises the calls of
    several threads (``None`` when unset: NIXL's Python API gives ``"none"`` to an agent without a listener
    thread, so its calls take no lock). vLLM's workers call one agent from more than one thread: the
    handshake executor adds remote agents and prepares their lists while the engine's thread posts and
    checks transfers, and a push worker's writer thread reads notifications and posts WRITEs besides.
    ``"rw"``: NIXL's reader-writer mode (metadata calls exclusive, transfers shared); ``"strict"``: every
    call under one lock; ``"none"``: no lock, as NIXL sets it."""
    value = _extra(vllm_config, SYNC_MODE_KEY)
    if value is None:
        return None
    if not isinstance(value, str) or value not in SYNC_MODES:
        raise ConfigError(
            f"kv_connector_extra_config.{SYNC_MODE_KEY}",
            f"must be one of {sorted(SYNC_MODES)}, got {value!r}",
            value=value,
            expected=sorted(SYNC_MODES),
        )
    return value


@contextmanager
def agent_settings(
    delay_us: int | None, sync_mode: str | None = None, nixl_module: Any = None
) -> Iterator[None]:
    """While an agent is built (vLLM's worker ``__init__``): NIXL agents get ``delay_us`` as their progress
    threads' delay and ``sync_mode`` (a key of :data:`SYNC_MODES`) as their thread synchronisation; ``None``
    keeps what NIXL's Python API sets. ``nixl_agent`` builds the C++ agent config itself and has no option
    for the delay (and NIXL 1.5's ``sync_mode`` option is not reachable through vLLM's wrapper); the config
    reaches NIXL's bindings' ``nixlAgent(name, config)``, which this wraps (in ``nixl_module``: the module
    of vLLM's ``NixlWrapper`` by default) and restores afterwards."""
    if delay_us is None and sync_mode is None:
        yield
        return
    if nixl_module is None:
        import sys

        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

        wrapper = getattr(base_worker, "NixlWrapper", None)
        nixl_module = sys.modules.get(getattr(wrapper, "__module__", ""), None)
    bindings = getattr(nixl_module, "nixlBind", None)
    if bindings is None or not hasattr(bindings, "nixlAgent"):
        if nixl_module is not None:  # a NIXL whose Python API builds its agent some other way
            _LOG.warning(
                "kv_connector_extra_config %s=%s, %s=%s not applied: %s has no nixlBind.nixlAgent",
                PROGRESS_DELAY_KEY, delay_us, SYNC_MODE_KEY, sync_mode, getattr(nixl_module, "__name__", nixl_module),
            )  # fmt: skip
        yield
        return
    sync = None
    if sync_mode is not None:
        sync = getattr(bindings, SYNC_MODES[sync_mode], None)
        if sync is None:
            raise ConfigError(
                f"kv_connector_extra_config.{SYNC_MODE_KEY}",
                f"this NIXL has no {SYNC_MODES[sync_mode]}",
                value=sync_mode,
                expected=sorted(m for m, name in SYNC_MODES.items() if hasattr(bindings, name)),
            )
    original = bindings.nixlAgent

    def configured(name: str, config: Any) -> Any:
        if delay_us is not None:
            config.pthrDelay = delay_us
        if sync is not None:
            config.syncMode = sync
        return original(name, config)

    with _AGENT_LOCK:
        bindings.nixlAgent = configured
        try:
            yield
        finally:
            bindings.nixlAgent = original


class KvgeomWorkerMixin:
    """The geometry methods of vLLM's NIXL worker, answered by kvgeom (installed from the table), plus
    what makes vLLM's own methods reach kvgeom: the dispatch mark on the methods that call vLLM's module
    functions by name, and the topology class."""

    #: "vllm" (default): refuse what vLLM 0.33.0 refuses; "kvgeom": let kvgeom decide (see kvgeom_mode.py)
    kvgeom_compat: str = "vllm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_conv_layout(args[2] if len(args) > 2 else kwargs.get("kv_cache_config"))
        vllm_config = args[0] if args else kwargs.get("vllm_config")
        settings = agent_settings(progress_delay_of(vllm_config), sync_mode_of(vllm_config))
        with _active(), settings:
            super().__init__(*args, **kwargs)

    def _kvgeom_plans(self, engine_id: str) -> bool:
        """Whether kvgeom plans this engine's requests: always in kvgeom mode, and in vLLM-compatible mode
        once the handshake paired both sides' cards; a peer without a card gets vLLM's per-request code."""
        return self.kvgeom_compat == "kvgeom" or engine_id in getattr(self, "kvgeom_pairings", {})

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        """Pull: kvgeom's plan (:mod:`kvgeom_vllm.kvgeom_mode`), or vLLM's per-request code for a peer
        without a card."""
        if not self._kvgeom_plans(meta.remote.engine_id):
            return super()._read_blocks_for_req(req_id, meta)  # type: ignore[misc]
        return counted_call(
            "NixlPullConnectorWorker._read_blocks_for_req",
            kvgeom_mode.read_blocks_for_req,
            self,
            req_id,
            meta,
        )

    def _do_start_push_kv(
        self, request_id: str, local_block_ids: Any, registration_data: dict[str, Any]
    ) -> None:
        """Push (P side): keep the token count D registered with the request (kvgeom's push scheduler adds it)
        for kvgeom's plan, then vLLM's code."""
        tokens = registration_data.get("kvgeom_num_tokens")
        if tokens is not None:
            self.__dict__.setdefault("_kvgeom_push_tokens", {})[request_id] = int(tokens)
        return super()._do_start_push_kv(request_id, local_block_ids, registration_data)  # type: ignore[misc]

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        """Push: kvgeom's plan, or vLLM's per-request code for a peer without a card."""
        if not self._kvgeom_plans(meta.remote.engine_id):
            return super()._xfer_blocks_for_req(req_id, meta)  # type: ignore[misc]
        return counted_call(
            "NixlPushConnectorWorker._xfer_blocks_for_req",
            kvgeom_mode.xfer_blocks_for_req,
            self,
            req_id,
            meta,
        )


_install(KvgeomWorkerMixin, "NixlBaseConnectorWorker")


class KvgeomRegistration(_BaseWorker):
    """vLLM's base worker with kvgeom's registration (region discovery and the card). It sits below vLLM's
    pull and push workers in the class order, so that their own ``register_kv_caches`` (the push writer
    thread) still runs around it."""

    #: the transfer topology kvgeom's ``register_kv_caches`` builds (:mod:`kvgeom_vllm.answers.registration`
    #: reads it here: the answers sit below the workers and import none of them)
    kvgeom_topology = KvgeomTransferTopology


_install(KvgeomRegistration, "NixlBaseConnectorWorker", base=True)


def _with_handshake(cls: type) -> type:
    cls.register_kv_caches = _marked(cls.register_kv_caches)
    cls.add_remote_agent = handshake.add_remote_agent_wrapper(_marked(cls.add_remote_agent))
    return cls


@_with_handshake
class KvgeomBaseWorker(KvgeomWorkerMixin, KvgeomRegistration):
    """vLLM's base NIXL worker with kvgeom geometry."""


@_with_handshake
class KvgeomPullConnectorWorker(KvgeomWorkerMixin, _PullWorker, KvgeomRegistration):
    """vLLM's pull (READ) NIXL worker with kvgeom geometry."""


@_with_handshake
class KvgeomPushConnectorWorker(KvgeomWorkerMixin, _PushWorker, KvgeomRegistration):
    """vLLM's push (WRITE) NIXL worker with kvgeom geometry."""


class KvgeomSchedulerMixin:
    """The geometry methods of vLLM's NIXL scheduler (which blocks and tokens a request exchanges),
    answered by kvgeom; the sliding-window block counts vLLM computes in ``__init__`` are kvgeom's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blocks_per_sw = counted_call(
            "NixlBaseConnectorScheduler.blocks_per_sw", answers.blocks_per_window, self
        )


_install(KvgeomSchedulerMixin, "NixlBaseConnectorScheduler")


class KvgeomPullConnectorScheduler(KvgeomSchedulerMixin, _PullScheduler):
    """vLLM's pull scheduler with kvgeom's exchange rules."""


class KvgeomPushConnectorScheduler(KvgeomSchedulerMixin, _PushScheduler):
    """vLLM's push scheduler with kvgeom's exchange rules. D's registration also carries the request's token
    count (``kvgeom_num_tokens``): P's worker places D's block list with it (a prefix hit on D skips
    blocks)."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is not None:
            registration["kvgeom_num_tokens"] = int(request.num_prompt_tokens)


# -- dispatchers for the module functions vLLM's worker calls by name ---------------------------------------
_DISPATCH_LOCK = threading.Lock()
_DISPATCHED = False
#: the dispatchers installed in vLLM's modules, by table row (the test plugin replaces them outright)
DISPATCHERS: dict[str, Callable[..., Any]] = {}
_BY_NAME = ("compute_tp_mapping", "derive_mamba_conv_split", "_region_sort_key")


def install_dispatchers() -> None:
    """Route the module functions vLLM's worker calls by name to kvgeom while a kvgeom worker runs (see
    the module doc); every other call keeps vLLM's function. Idempotent."""
    global _DISPATCHED
    with _DISPATCH_LOCK:
        if _DISPATCHED:
            return
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

        for name in _BY_NAME:
            original = getattr(base_worker, name)
            kvgeom_fn = counted(entry(name))

            def dispatcher(
                *args: Any, _original: Any = original, _kvgeom: Any = kvgeom_fn, **kwargs: Any
            ) -> Any:
                return (_kvgeom if _ACTIVE.get() else _original)(*args, **kwargs)

            functools.update_wrapper(dispatcher, original)
            setattr(base_worker, name, dispatcher)
            DISPATCHERS[name] = dispatcher
        # The handshake decodes peers' metadata with this name: the subclass keeps their card (a plain vLLM
        # worker ignores the field, and reads None from a plain peer).
        if base_worker.NixlAgentMetadata is metadata.PlainAgentMetadata:
            base_worker.NixlAgentMetadata = metadata.KvgeomAgentMetadata
        _DISPATCHED = True


install_dispatchers()
