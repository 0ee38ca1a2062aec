"""Compare the vLLM functions kvgeom_vllm answers (its table) between two installed vLLM versions.

    python tests/serving/vllm_versions.py SITE_A SITE_B   # two site-packages folders, each holding vllm/

Each row of :data:`kvgeom_vllm.table.TABLE` names a vLLM module and ``Class.member`` or function. This
reads both versions' source files (no import: the two vLLMs need not be importable here), finds the
member's definition (for an ``attribute`` row: the class's ``__init__`` / ``__post_init__``, where vLLM
computes it), and compares the two by their syntax trees without docstrings, so that only code changes
count. It prints one markdown row per table row: ``identical``, ``differs`` (with the changed line counts),
or ``missing in A`` / ``missing in B``. docs/vllm-versions.md holds the result for 0.32.0 and 0.33.0.
"""

from __future__ import annotations

import ast
import difflib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "adapters"))

from kvgeom_vllm.table import TABLE  # noqa: E402


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            n.body = body[1:] or [ast.Pass()]
    return node


def _find(tree: ast.Module, qualname: str, kind: str) -> ast.AST | None:
    parts = qualname.split(".")
    scope: list[ast.stmt] = tree.body
    if len(parts) == 2:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == parts[0]), None)
        if cls is None:
            return None
        scope = cls.body
        names = ["__post_init__", "__init__"] if kind == "attribute" else [parts[1]]
        for name in names:
            for n in scope:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                    if kind != "attribute" or parts[1] in ast.unparse(n):
                        return n
        return None
    return next(
        (n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == parts[0]),
        None,
    )


def _source(site: Path, module: str, qualname: str, kind: str) -> str | None:
    path = site / (module.replace(".", "/") + ".py")
    if not path.exists():
        return None
    node = _find(ast.parse(path.read_text()), qualname, kind)
    return None if node is None else ast.unparse(_strip_docstrings(node))


def compare(site_a: Path, site_b: Path) -> list[tuple[str, str]]:
    rows = []
    for e in TABLE:
        a = _source(site_a, e.module, e.qualname, e.kind)
        b = _source(site_b, e.module, e.qualname, e.kind)
        if a is None or b is None:
            verdict = "missing in " + ("both" if a is None and b is None else "A" if a is None else "B")
        elif a == b:
            verdict = "identical"
        else:
            diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0))
            minus = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
            plus = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
            verdict = f"differs (-{minus} +{plus} lines)"
        rows.append((f"`{e.module.rsplit('.', 1)[-1]}.{e.qualname}`", verdict))
    return rows


def main(argv: list[str]) -> int:
    site_a, site_b = Path(argv[1]), Path(argv[2])
    rows = compare(site_a, site_b)
    print("| vLLM function | A -> B |")
    print("| --- | --- |")
    for name, verdict in rows:
        print(f"| {name} | {verdict} |")
    counts: dict[str, int] = {}
    for _, v in rows:
        key = v.split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    print()
    print(", ".join(f"{k}: {n}" for k, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
