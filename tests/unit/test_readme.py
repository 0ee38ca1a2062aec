"""The README's Python snippets, and those marked ``<!-- runnable -->`` in docs/, run as written; links to
files inside the repository resolve; no document refers to material outside the repository."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _snippets(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.name == "README.md":
        return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    return re.findall(r"^<!-- runnable -->\n```python\n(.*?)^```", text, re.S | re.M)


SNIPPETS = [(p, i, code) for p in [ROOT / "README.md", *DOCS] for i, code in enumerate(_snippets(p))]


def test_the_readme_has_its_snippets() -> None:
    assert len(_snippets(ROOT / "README.md")) == 2
    assert {p.name for p, _, _ in SNIPPETS} >= {"README.md", "models.md", "cli.md"}


@pytest.mark.parametrize(("path", "index", "code"), SNIPPETS, ids=[f"{p.name}#{i}" for p, i, _ in SNIPPETS])
def test_snippet_runs_as_written(path: Path, index: int, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{path.name} snippet {index}", "exec"), {"__name__": f"snippet_{index}"})  # noqa: S102
    printed = out.getvalue()
    # where a snippet's comment states its output, the output is that
    for expected in re.findall(r"print\(.*\)\s+#.*?(\[[\d, ]+\])", code):
        assert expected in printed, (expected, printed)


def test_links_resolve_and_nothing_outside_is_cited() -> None:
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS]:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+://", target):
                assert (path.parent / target).exists(), f"{path.name}: broken link {target}"
        assert not re.search(r"primer|/work/shared|\.\./shared|nixl-notes|vllm-reference-env", text, re.I), (
            path.name
        )


OUTSIDE = re.compile(
    r"primer|/work/shared|\.\./shared|shared/(?:models|golden|docs)|nixl-notes|vllm-reference-env", re.I
)


def test_no_file_refers_to_material_outside_the_repository() -> None:
    """Code, tests, data notes and build files too: every fact they rely on is in docs/."""
    kinds = {".py", ".md", ".sh", ".toml", ".cfg", ".txt", ".yml", ".yaml"}
    files = [
        p
        for top in ("kvgeom", "adapters", "tests", "bench", ".ci")
        for p in (ROOT / top).rglob("*")
        if p.is_file() and (p.suffix in kinds or p.parent.name == ".ci") and "__pycache__" not in p.parts
    ]
    files += [p for p in (ROOT / "Makefile", ROOT / "pyproject.toml") if p.exists()]  # mutmut copies neither
    assert len(files) > 100
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in files
        if p != Path(__file__).resolve()
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []
