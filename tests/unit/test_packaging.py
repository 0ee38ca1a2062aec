"""The wheel and the sdist, built from this tree: one version, no generic top-level names, what the help
mentions is installed, the license travels, and a fresh sdist has what `make demo` / `make test` need."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kvgeom

ROOT = Path(__file__).resolve().parents[2]


_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".vllm-src",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "mutants",
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and sdist built from a copy of this tree's sources: a build writes ``*.egg-info`` into the
    tree it builds, and ``make test`` installs the tree (editable) into the vLLM venvs meanwhile."""
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "kvgeom"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE, symlinks=True)
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def test_wheel(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"kvgeom", "kvgeom_nixl", "kvgeom_lab", "kvgeom_mooncake"} | (
        {"kvgeom_vllm"} if any(n.startswith("kvgeom_vllm/") for n in names) else set()
    )
    for name in (
        "kvgeom/py.typed",
        "kvgeom/examples/nemotron-h-8b_p2_d1_pull.json",
        "kvgeom/examples/demo-mamba2-hybrid_p2_d1_pull.json",
        "kvgeom/model/presets/qwen3-8b.json",
        "kvgeom/cli/__init__.py",
        "kvgeom/model/hfconfig.py",
        "kvgeom/tools/draw.py",
    ):
        assert name in names
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(info))
    assert meta["Version"] == kvgeom.__version__ and wheel.name.startswith(f"kvgeom-{kvgeom.__version__}-")
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert set(meta.get_all("Provides-Extra")) >= {"nixl", "lab", "mooncake", "plot", "test", "vllm", "dev"}
    for name in (
        "kvgeom_lab/demo.py",
        "kvgeom_lab/cluster.py",
        "kvgeom_nixl/kvrank.py",
        "kvgeom_mooncake/rank.py",
    ):
        assert name in names
    assert not any(n.startswith("kvgeom_nixl/") and n.endswith(("/demo.py", "/cluster.py")) for n in names)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "demo = kvgeom_lab.demo" in zipfile.ZipFile(wheel).read(entry).decode()
    requires = meta.get_all("Requires-Dist")
    torch = [r for r in requires if r.startswith("torch")]
    assert torch and not any("<" in r.split(";")[0] for r in torch)  # the current torch release installs
    assert "Typing :: Typed" in meta.get_all("Classifier")


def test_sdist(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        readme = (
            tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/README.md")))
            .read()
            .decode()
        )
    for name in (
        "Makefile",
        "constraints-dev.txt",
        "LICENSE",
        "CHANGELOG.md",
        ".ci/run",
        "docs/cli.md",
        "docs/vllm-behaviour.md",
        "docs/img/demo-pair.png",
        "tests/unit/test_cli.py",
        "tests/data/hf/qwen3-8b/config.json",
        "examples/nemotron-h-8b_p2_d1_pull.json",
        "adapters/kvgeom_lab/demo.py",
        "bench/bench_plan.py",
    ):
        assert name in names, name
    assert "make demo" in readme.split("\n\n", 2)[1]  # the README opens with the Makefile's commands


def test_one_version_source() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert 'dynamic = ["version"]' in project and not re.search(r"^version\s*=", project, re.M)
    assert 'version = { attr = "kvgeom.__version__" }' in text
    assert re.search(rf"^## \[?{re.escape(kvgeom.__version__)}\]?", (ROOT / "CHANGELOG.md").read_text(), re.M)
