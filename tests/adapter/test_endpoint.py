"""One Endpoint in this process (no peer): registration, local prep, argument checks, close."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from kvgeom_nixl import AdapterError, Endpoint, Region, TransferError, TransportConfig  # noqa: E402

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def ep():
    e = Endpoint("solo", TransportConfig(close_drain_s=0.0))
    yield e
    e.close()


def test_register_tensors_regions_and_generation(ep):
    a = torch.zeros(1024, dtype=torch.int64)
    b = torch.ones(16, 4, dtype=torch.float16)
    g0 = ep.generation
    regions = ep.register_tensors([a, b])
    assert regions == [Region(a.data_ptr(), 8192, 0, "DRAM"), Region(b.data_ptr(), 128, 0, "DRAM")]
    assert ep.generation == g0 + 1
    assert ep.regions[-2:] == regions
    md = ep.metadata()
    assert isinstance(md, bytes) and b"solo" in md
    assert ep.register_tensors(torch.zeros(3)) == [Region(ep.regions[-1].addr, 12, 0, "DRAM")]


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: torch.zeros(8, 8).t(), "not contiguous"),
        (lambda: torch.zeros(0), "empty"),
        (lambda: np.zeros(4), "torch.Tensor"),
        (lambda: torch.zeros(4, device="meta"), "neither cpu nor cuda"),
    ],
)
def test_register_refuses_what_nixl_cannot_describe(ep, bad, match):
    n = len(ep.regions)
    with pytest.raises(ValueError, match=match):
        ep.register_tensors([torch.zeros(4), bad()])
    assert len(ep.regions) == n  # all or nothing


def test_prep_local_checks_coverage_and_shapes(ep):
    t = torch.zeros(4096, dtype=torch.uint8)
    (r,) = ep.register_tensors(t)
    ok = ep.prep_local(np.array([[r.addr, 1024, 0], [r.addr + 3072, 1024, 0]], dtype=np.uint64))
    assert ok.count == 2 and ok.peer is None
    ok.release()
    assert ok.released
    with pytest.raises(TransferError) as ei:
        ep.prep_local(np.array([[r.addr + 2048, 4096, 0]], dtype=np.uint64))
    assert ei.value.status == "NIXL_ERR_NOT_FOUND" and ei.value.stage == "prep_local"
    with pytest.raises(ValueError, match="N×3"):
        ep.prep_local(np.zeros((2, 4), dtype=np.uint64))
    with pytest.raises(ValueError, match="negative"):
        ep.prep_local(np.array([[-1, 4, 0]]))
    with pytest.raises(ValueError, match="mem_type"):
        ep.prep_local(np.array([[r.addr, 4, 0]], dtype=np.uint64), "GPU")
    with pytest.raises(TransferError, match="unknown peer"):
        ep.prep_remote("nobody", np.array([[r.addr, 4, 0]], dtype=np.uint64))


def test_notifications_empty_and_timeout(ep):
    assert ep.notifications() == {}
    with pytest.raises(TransferError) as ei:  # NotifTimeout is a TransferError
        ep.wait_notifications(None, b"x", 1, timeout_s=0.05)
    assert ei.value.status == "TIMEOUT"


def test_close_is_idempotent_and_final():
    e = Endpoint("short-lived", TransportConfig(close_drain_s=0.01))
    e.register_tensors(torch.zeros(16))
    e.prep_local(np.array([[e.regions[0].addr, 8, 0]], dtype=np.uint64))
    e.close()
    e.close()
    with pytest.raises(AdapterError, match="closed"):
        e.metadata()
