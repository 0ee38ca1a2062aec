"""``KvgeomMooncakeConnector``: vLLM 0.33.0's Mooncake connector with its geometry answered by kvgeom.

The worker, scheduler and connector subclass vLLM's (``MooncakeConnectorWorker``,
``MooncakeConnectorScheduler``, ``MooncakeConnector``); their geometry members are the adapters of
:mod:`kvgeom_vllm.mooncake.answers`, counted per row of :data:`kvgeom_vllm.mooncake.table.TABLE`. vLLM's
sender and receiver threads, bootstrap server, ZMQ side channel, layout cache and completion tracking run
unchanged. vLLM's worker calls four geometry functions by module name (``_get_tp_ratio``,
``_compute_sender_transfer_plan``, ``_validate_asymmetric_region_lengths``, ``_block_ids_for_region``):
:func:`install_dispatchers` replaces them in vLLM's module by dispatchers that answer with kvgeom while a
kvgeom worker's method runs (kvgeom_vllm's context mark, :func:`kvgeom_vllm.worker.kvgeom_active`), and
with vLLM's function otherwise, so a plain ``MooncakeConnector`` in the same process keeps vLLM's
behaviour.

Refused at start-up, with a typed :class:`~kvgeom.errors.KvgeomError` (also the exception class vLLM
raises there): a vLLM other than 0.33.0 (:class:`~kvgeom_vllm.version.VllmVersionError`), a missing
transfer engine, decode or prefill context parallelism (the connector copies whole token blocks; a
DCP-sharded cache is not one), host-resident (HiSparse) cache groups. Refused per pair, as vLLM refuses a
pair (an error response to D, which recomputes the request): a hybrid with recurrent state across TP
sizes (:func:`~kvgeom_vllm.mooncake.answers.refuse_state_across_tp`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..version import VllmVersionError, check_vllm_version

MOONCAKE_VLLM_VERSIONS = ("0.33.0",)
MISSING_HINT = (
    "install Mooncake's transfer engine (pip install 'kvgeom[mooncake]', the wheel "
    "mooncake-transfer-engine-non-cuda; on Debian also apt-get install libibverbs1 librdmacm1)"
)


def check_mooncake_vllm_version(version: str | None = None) -> str:
    """The installed vLLM, or :class:`VllmVersionError`: the Mooncake connector is answered for vLLM 0.33.0
    only (its geometry functions were read in that version's sources)."""
    found = check_vllm_version(version)
    if found not in MOONCAKE_VLLM_VERSIONS:
        raise VllmVersionError(
            "vllm",
            f"kvgeom_vllm's Mooncake connector supports vLLM {' or '.join(MOONCAKE_VLLM_VERSIONS)} only, "
            f"found {found}: use vLLM's own MooncakeConnector there",
            value=found,
            expected=MOONCAKE_VLLM_VERSIONS,
        )
    return found


check_mooncake_vllm_version()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as _mc  # noqa: E402

from kvgeom.errors import ConfigError, KvgeomError, SpecError  # noqa: E402

from .. import worker as _kvworker  # noqa: E402
from ..calls import as_vllm_error  # noqa: E402
from . import answers  # noqa: E402
from .table import TABLE, Entry, counted_call, entry  # noqa: E402

__all__ = [
    "KvgeomMooncakeConnector",
    "KvgeomMooncakeConnectorWorker",
    "KvgeomMooncakeConnectorScheduler",
    "MOONCAKE_VLLM_VERSIONS",
    "check_mooncake_vllm_version",
    "check_startup",
    "counted",
    "install_dispatchers",
    "DISPATCHERS",
]


def counted(e: Entry) -> Callable[..., Any]:
    """The adapter of row ``e``, counted."""
    fn = getattr(answers, e.answer)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return counted_call(e.qualname, fn, *args, **kwargs)

    wrapper.__kvgeom_entry__ = e  # type: ignore[attr-defined]
    return wrapper


def check_startup(vllm_config: Any, kv_cache_config: Any) -> None:
    """What this connector refuses before anything is registered (see the module doc)."""
    if _mc.TransferEngine is None:
        raise as_vllm_error(
            ConfigError("mooncake", f"Mooncake's transfer engine does not load: {MISSING_HINT}", value=None),
            RuntimeError,
        )
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise as_vllm_error(
                ConfigError(
                    name,
                    "the Mooncake connector copies whole token blocks; a context-parallel cache shards them",
                    value=size,
                    expected=1,
                ),
                RuntimeError,
            )
    groups = getattr(kv_cache_config, "transfer_groups", None) or []
    hosted = [i for i, g in enumerate(groups) if getattr(g, "host_resident", False)]
    if hosted:
        raise as_vllm_error(
            SpecError(
                "kv_cache_groups",
                "host-resident (HiSparse) cache groups have no kvgeom geometry",
                value=hosted,
            ),
            RuntimeError,
        )


_DEVICE_LOCK = threading.Lock()


@contextlib.contextmanager
def _cpu_device_index() -> Iterator[None]:
    """vLLM 0.33.0's Mooncake worker asks torch for the current accelerator in ``__init__``; a host without
    one (vLLM's CPU platform) raises there. On such a host the kvgeom worker answers 0 (the CPU device)
    while vLLM's ``__init__`` runs; with an accelerator nothing changes."""
    if torch.accelerator.is_available():
        yield
        return
    with _DEVICE_LOCK:
        original = torch.accelerator.current_device_index
        torch.accelerator.current_device_index = lambda: 0
        try:
            yield
        finally:
            torch.accelerator.current_device_index = original


def _marked(method: Callable[..., Any]) -> Callable[..., Any]:
    """A worker method run under kvgeom's mark (the module-function dispatchers answer with kvgeom)."""
    if _is_coroutine(method):

        @functools.wraps(method)
        async def amarked(*args: Any, **kwargs: Any) -> Any:
            token = _kvworker._ACTIVE.set(True)
            try:
                return await method(*args, **kwargs)
            finally:
                _kvworker._ACTIVE.reset(token)

        return amarked

    @functools.wraps(method)
    def marked(*args: Any, **kwargs: Any) -> Any:
        token = _kvworker._ACTIVE.set(True)
        try:
            return method(*args, **kwargs)
        finally:
            _kvworker._ACTIVE.reset(token)

    return marked


def _is_coroutine(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


_W = "MooncakeConnectorWorker"


class KvgeomMooncakeConnectorWorker(_mc.MooncakeConnectorWorker):
    """vLLM's Mooncake worker with kvgeom geometry."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_startup(vllm_config, kv_cache_config)
        with _cpu_device_index():
            _marked(super().__init__)(vllm_config, engine_id, kv_cache_config)
        self.transfer_topo = counted(entry(f"{_W}.transfer_topo"))(self.transfer_topo)

    def _prepare_transfer_regions(self, meta: Any) -> Any:
        """vLLM's alignment of the peer's regions, after kvgeom's refusal of a recurrent-state pair across
        TP sizes (returned as vLLM returns a refusal: no regions and the reason)."""
        name = f"{_W}._prepare_transfer_regions"
        try:
            counted_call(name, answers.refuse_state_across_tp, self, meta.remote_tp_size)
        except KvgeomError as exc:  # kvgeom's refusal: vLLM's error response to D
            return [], [], f"kvgeom: {exc}"
        return _marked(super()._prepare_transfer_regions)(meta)

    async def send_kv_to_decode(self, identity: bytes, sock: Any, meta: Any) -> None:
        await _marked(super().send_kv_to_decode)(identity, sock, meta)

    async def _build_transfer_params(self, *args: Any, **kwargs: Any) -> Any:
        return await _marked(super()._build_transfer_params)(*args, **kwargs)

    async def receive_kv_from_single_worker(self, *args: Any, **kwargs: Any) -> Any:
        return await _marked(super().receive_kv_from_single_worker)(*args, **kwargs)


class KvgeomMooncakeConnectorScheduler(_mc.MooncakeConnectorScheduler):
    """vLLM's Mooncake scheduler with kvgeom's exchange rules (window blocks, their clipping, the tokens D
    loads)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blocks_per_sw = counted(entry("MooncakeConnectorScheduler.blocks_per_sw"))(self)


def _install(cls: type, owner: str) -> None:
    for e in TABLE:
        if e.owner == owner and e.kind == "method":
            setattr(cls, e.attr, counted(e))


_install(KvgeomMooncakeConnectorWorker, _W)
_install(KvgeomMooncakeConnectorScheduler, "MooncakeConnectorScheduler")


class KvgeomMooncakeConnector(_mc.MooncakeConnector):
    """vLLM's ``MooncakeConnector`` with kvgeom's worker and scheduler. Turn it on with
    ``{"kv_connector": "KvgeomMooncakeConnector", "kv_connector_module_path": "kvgeom_vllm.mooncake"}``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc is None or ktc.engine_id is None:
            raise as_vllm_error(
                ConfigError(
                    "kv_transfer_config.engine_id", "the Mooncake connector needs an engine id", value=None
                ),
                AssertionError,
            )
        self.engine_id = ktc.engine_id
        self.connector_scheduler: Any = None
        self.connector_worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvgeomMooncakeConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvgeomMooncakeConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )


# -- dispatchers for the module functions vLLM's worker calls by name ---------------------------------------
_DISPATCH_LOCK = threading.Lock()
_DISPATCHED = False
#: the dispatchers installed in vLLM's Mooncake module, by row (the test plugin replaces them outright)
DISPATCHERS: dict[str, Callable[..., Any]] = {}


def install_dispatchers() -> None:
    """Route the module functions of vLLM's Mooncake module to kvgeom while a kvgeom worker runs (see the
    module doc); every other call keeps vLLM's function. Idempotent."""
    global _DISPATCHED
    with _DISPATCH_LOCK:
        if _DISPATCHED:
            return
        for e in TABLE:
            if e.kind != "function":
                continue
            original = getattr(_mc, e.attr)
            kvgeom_fn = counted(e)

            def dispatcher(
                *args: Any, _original: Any = original, _kvgeom: Any = kvgeom_fn, **kwargs: Any
            ) -> Any:
                return (_kvgeom if _kvworker.kvgeom_active() else _original)(*args, **kwargs)

            functools.update_wrapper(dispatcher, original)
            setattr(_mc, e.attr, dispatcher)
            DISPATCHERS[e.qualname] = dispatcher
        _DISPATCHED = True


install_dispatchers()
