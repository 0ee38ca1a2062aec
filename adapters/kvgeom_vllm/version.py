"""The vLLM versions kvgeom_vllm supports, checked when the connector is loaded.

The integration subclasses vLLM's NIXL worker and replaces its geometry methods by name; another vLLM
version may have renamed, re-signed or re-meant any of them, so every other version is refused at
start-up rather than half-working.
"""

from __future__ import annotations

from kvgeom.errors import ConfigError

__all__ = ["SUPPORTED_VLLM_VERSIONS", "VllmVersionError", "check_vllm_version"]

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.33.0",)


class VllmVersionError(ConfigError, ImportError):
    """The installed vLLM is not one kvgeom_vllm was built and tested against."""


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`VllmVersionError` (one line) if it is not
    supported. ``version`` overrides the installed one (for tests)."""
    if version is None:
        try:
            import vllm
        except ImportError as exc:
            raise VllmVersionError(
                "vllm",
                f"kvgeom_vllm needs vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)}, and "
                f"vLLM is not installed ({exc})",
                value=None,
                expected=SUPPORTED_VLLM_VERSIONS,
            ) from None
        version = str(getattr(vllm, "__version__", "unknown"))
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise VllmVersionError(
            "vllm",
            f"kvgeom_vllm supports vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)} only, "
            f"found {version}: install vllm=={SUPPORTED_VLLM_VERSIONS[-1]} or use vLLM's own "
            "NixlConnector",
            value=version,
            expected=SUPPORTED_VLLM_VERSIONS,
        )
    return version
