"""The core and the production adapters stay readable in pieces: no module of ``kvgeom``, ``kvgeom_nixl``,
``kvgeom_mooncake`` or ``kvgeom_vllm`` (:data:`PACKAGES`) over :data:`MODULE_LINES` lines and no function
over :data:`FUNCTION_LINES` (a function's lines from ``def`` to its last line, docstring and signature
included), except those in :data:`LONG_MODULES` and :data:`LONG_FUNCTIONS`, each with the reason it is one
piece. The allowlists cannot go stale: an entry that is no longer long fails too; and every package under
``adapters/`` is either held to the limits or named in :data:`LEFT_OUT` with the reason (docs/architecture.md)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE_LINES = 500
FUNCTION_LINES = 60
#: package -> the folder that holds it: the packages held to the limits
PACKAGES = {
    "kvgeom": ROOT,
    "kvgeom_nixl": ROOT / "adapters",
    "kvgeom_mooncake": ROOT / "adapters",
    "kvgeom_vllm": ROOT / "adapters",
}
#: packages under ``adapters/`` not held to the limits -> why
LEFT_OUT: dict[str, str] = {
    "kvgeom_lab": (
        "test-host and demo tooling (network namespaces, process clusters, floods), not a serving path; "
        "its long pieces are scenario scripts read top to bottom"
    ),
}

#: ``package/path.py`` (relative to the package's folder) -> why it stays one module
LONG_MODULES: dict[str, str] = {}

#: ``module:qualified name`` -> why it stays one function
LONG_FUNCTIONS: dict[str, str] = {
    "kvgeom.plan.descids:desc_segments": (
        "its signature is vLLM's _compute_desc_ids parameter list (18 lines) and its docstring states the "
        "four paths; the body only checks sizes and dispatches, each path is its own function"
    ),
}


def _long_in(node: ast.AST, module: str, prefix: str, limit: int, found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            lines = (child.end_lineno or child.lineno) - child.lineno + 1
            if lines > limit:
                found[f"{module}:{name}"] = lines
            _long_in(child, module, f"{name}.", limit, found)
        elif isinstance(child, ast.ClassDef):
            _long_in(child, module, f"{prefix}{child.name}.", limit, found)


def long_functions(root: Path, package: str, limit: int = FUNCTION_LINES) -> dict[str, int]:
    """``module:qualified name`` -> lines, for every function of ``package`` under ``root`` over ``limit``."""
    found: dict[str, int] = {}
    for path in sorted((root / package).rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        _long_in(ast.parse(path.read_text(), str(path)), module, "", limit, found)
    return found


def long_modules(root: Path, package: str, limit: int = MODULE_LINES) -> dict[str, int]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out[str(path.relative_to(root))] = lines
    return out


def _found(measure: Callable[[Path, str], dict[str, int]]) -> dict[str, int]:
    found: dict[str, int] = {}
    for package, root in PACKAGES.items():
        found.update(measure(root, package))
    return found


def test_no_function_of_the_core_or_an_adapter_is_longer_than_the_limit_but_the_listed_ones() -> None:
    found = _found(long_functions)
    assert sorted(set(found) - set(LONG_FUNCTIONS)) == []
    assert sorted(set(LONG_FUNCTIONS) - set(found)) == []  # a listed function that got short leaves the list


def test_no_module_of_the_core_or_an_adapter_is_longer_than_the_limit_but_the_listed_ones() -> None:
    found = _found(long_modules)
    assert sorted(set(found) - set(LONG_MODULES)) == []
    assert sorted(set(LONG_MODULES) - set(found)) == []  # a listed module that got short leaves the list


def test_every_adapter_package_is_held_to_the_limits_or_left_out_with_a_reason() -> None:
    adapters = {d.name for d in (ROOT / "adapters").iterdir() if (d / "__init__.py").is_file()}
    assert adapters == (set(PACKAGES) - {"kvgeom"}) | set(LEFT_OUT)
    assert not set(PACKAGES) & set(LEFT_OUT)
    assert all(
        reason.strip() for reason in [*LEFT_OUT.values(), *LONG_MODULES.values(), *LONG_FUNCTIONS.values()]
    )


def test_a_long_function_and_a_long_module_are_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(
        f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body.replace('    ', '        ')}\n"
        f"\n\ndef outer():\n    def inner():\n{body.replace('    ', '        ')}\n    return inner\n"
    )
    assert long_functions(tmp_path, "pkg") == {"pkg.m:C.long": 62, "pkg.m:outer": 64, "pkg.m:outer.inner": 62}
    assert long_modules(tmp_path, "pkg", limit=100) == {"pkg/m.py": 133}
