"""The import rules of docs/architecture.md, drawn from the source: every ``import`` and ``from ... import``
of ``kvgeom`` and of each package under ``adapters/`` (those inside functions too: they hide cycles), and
``importlib.import_module`` of a literal name.

* no import cycle among the modules;
* layers (:data:`LAYERS`): the core (``kvgeom``) imports no test facility and no adapter; the test facility
  (``kvgeom.testing``) imports the core only; adapters import the core, not one another's modules; the
  test host and demo tooling (``kvgeom_lab``) sits above the transport: it may import the core, the test
  facility and ``kvgeom_nixl``, and nothing imports it;
* the core imports none of the accelerator stacks (torch, NIXL, vLLM, Mooncake);
* no production module (the core, the transport, the vLLM connector) imports ``kvgeom.testing``: only the
  tooling does;
* ``kvgeom`` and ``kvgeom.testing`` are facades: ``__all__`` sorted, without repeats, every name there.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE, TESTING = "kvgeom", "kvgeom.testing"
LAB, TRANSPORT, MOONCAKE = "kvgeom_lab", "kvgeom_nixl", "kvgeom_mooncake"
FORBIDDEN_IN_CORE = frozenset({"torch", "nixl", "vllm", "mooncake", TRANSPORT, MOONCAKE, "kvgeom_vllm", LAB})
#: the layers each layer may import (docs/architecture.md); an adapter not named here: the core and itself
LAYERS = {
    "core": {"core"},
    "testing": {"core", "testing"},
    TRANSPORT: {"core", TRANSPORT},
    MOONCAKE: {"core", MOONCAKE},  # the second transport: no NIXL adapter, no test facility
    "kvgeom_vllm": {"core", "kvgeom_vllm"},
    LAB: {"core", "testing", TRANSPORT, LAB},
}


@dataclass
class Graph:
    """Modules (dotted name -> source file), and per module the modules of the tree it imports and the
    top-level names of everything it imports (the tree's own packages included)."""

    files: dict[str, Path] = field(default_factory=dict)
    internal: dict[str, set[str]] = field(default_factory=dict)
    external: dict[str, set[str]] = field(default_factory=dict)


def packages(root: Path = ROOT) -> dict[str, Path]:
    """The core and every adapter package (a folder of ``adapters/`` with an ``__init__.py``)."""
    found = {CORE: root / CORE}
    for d in sorted((root / "adapters").iterdir()):
        if (d / "__init__.py").is_file():
            found[d.name] = d
    return found


def _modules(pkgs: Mapping[str, Path]) -> dict[str, tuple[Path, bool]]:
    out: dict[str, tuple[Path, bool]] = {}
    for name, root in pkgs.items():
        for f in sorted(root.rglob("*.py")):
            parts = [name, *f.relative_to(root).with_suffix("").parts]
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _absolute(target: str, level: int, module: str, is_pkg: bool) -> str:
    """``from .x import`` seen from ``module``: the dotted name it means."""
    if not level:
        return target
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _literal_import(node: ast.Call) -> str | None:
    """The name in ``importlib.import_module("name")`` / ``import_module("name")``, if a literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imported_names(tree: ast.AST, module: str, is_pkg: bool) -> Iterator[tuple[str, str | None]]:
    """Every ``(module, name)`` the tree imports, anywhere in it (``name``: what a ``from`` imports)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node.module or "", node.level, module, is_pkg)
            yield from ((target, a.name) for a in node.names)
        elif isinstance(node, ast.Call) and (lit := _literal_import(node)) is not None:
            yield (_absolute(lit.lstrip("."), len(lit) - len(lit.lstrip(".")), module, is_pkg), None)


def _resolve(name: str, known: Mapping[str, object]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def draw(pkgs: Mapping[str, Path]) -> Graph:
    """The import graph of these packages' modules."""
    mods = _modules(pkgs)
    g = Graph()
    for module, (path, is_pkg) in mods.items():
        g.files[module] = path
        g.internal[module], g.external[module] = set(), set()
        for target, name in imported_names(ast.parse(path.read_text(), str(path)), module, is_pkg):
            g.external[module].add(target.split(".")[0])
            full = f"{target}.{name}" if name else target
            hit = full if full in mods else _resolve(target, mods)
            if hit is not None and hit != module:
                g.internal[module].add(hit)
    return g


def find_cycle(edges: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None`` when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


@pytest.fixture(scope="module")
def graph() -> Graph:
    return draw(packages())


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> str:
    if _in(module, TESTING):
        return "testing"
    return "core" if _in(module, CORE) else module.split(".")[0]


# -- the rules -------------------------------------------------------------------------------------------
def test_the_modules_import_one_another_without_a_cycle(graph: Graph) -> None:
    assert len(graph.files) > 80  # the whole tree was drawn: the core and both adapters
    assert {m.split(".")[0] for m in graph.files} == {"kvgeom", TRANSPORT, MOONCAKE, "kvgeom_vllm", LAB}
    cycle = find_cycle(graph.internal)
    assert cycle is None, " -> ".join(cycle or [])


def test_each_layer_imports_only_the_layers_below(graph: Graph) -> None:
    upward = sorted(
        (m, t)
        for m, targets in graph.internal.items()
        for t in targets
        if _layer(t) not in LAYERS.get(_layer(m), {"core", _layer(m)})
    )
    assert upward == []


#: the core's stages in pipeline order (docs/architecture.md): a module imports only its own stage and
#: the stages before it; the facade (``kvgeom``, ``kvgeom.__main__``) sits above them all
STAGES = (
    ("kvgeom.errors", "kvgeom.dtypes", "kvgeom.modes", "kvgeom.blocks"),
    ("kvgeom.model",),
    ("kvgeom.layout",),
    ("kvgeom.pair",),
    ("kvgeom.plan",),
    ("kvgeom.compat",),
    ("kvgeom.tools",),
    ("kvgeom.cli",),
)


def stage_of(module: str) -> int | None:
    """The pipeline stage of a core module (``None``: the test facility, the facade, an adapter)."""
    for rank, prefixes in enumerate(STAGES):
        if any(_in(module, p) for p in prefixes):
            return rank
    return None


def test_every_core_module_lies_in_a_stage_and_imports_only_earlier_stages(graph: Graph) -> None:
    core = [m for m in graph.files if _layer(m) == "core" and m not in (CORE, f"{CORE}.__main__")]
    assert core and [m for m in core if stage_of(m) is None] == []
    upward = sorted(
        (m, t)
        for m in core
        for t in graph.internal[m]
        if _layer(t) == "core" and stage_of(t) is not None and stage_of(t) > stage_of(m)  # type: ignore[operator]
    )
    assert upward == []


def test_a_stage_importing_a_later_stage_is_found(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "kvgeom/__init__.py": "",
            "kvgeom/errors.py": "",
            "kvgeom/layout/__init__.py": "",
            "kvgeom/layout/geometry.py": "from kvgeom.plan.request import plan_request\n",
            "kvgeom/plan/__init__.py": "",
            "kvgeom/plan/request.py": "from kvgeom.layout.geometry import x\n",
        },
    )
    g = draw({CORE: tmp_path / CORE})
    assert find_cycle(g.internal) is not None
    up = [(m, t) for m in g.files for t in g.internal[m] if (stage_of(t) or 0) > (stage_of(m) or 0)]
    assert up == [("kvgeom.layout.geometry", "kvgeom.plan.request")]


def test_the_lab_sits_above_the_transport_and_nothing_imports_it(graph: Graph) -> None:
    transport = {m for m in graph.files if _in(m, TRANSPORT)}
    lab = {m for m in graph.files if _in(m, LAB)}
    assert {"kvgeom_lab.cluster", "kvgeom_lab.demo", "kvgeom_lab.procs", "kvgeom_lab.netns"} <= lab
    assert not any(m.split(".")[-1] in {"cluster", "demo", "procs", "netns", "hostrun"} for m in transport)
    importers = sorted(m for m, targets in graph.internal.items() if m not in lab and targets & lab)
    assert importers == []
    assert sorted(m for m in transport if LAB in graph.external[m]) == []  # not even by a literal name
    assert any(targets & transport for m, targets in graph.internal.items() if m in lab)


def test_the_core_imports_no_accelerator_stack_and_no_adapter(graph: Graph) -> None:
    found = sorted(
        (m, name) for m, names in graph.external.items() if _in(m, CORE) for name in names & FORBIDDEN_IN_CORE
    )
    assert found == []


def test_only_test_tooling_imports_the_test_facility(graph: Graph) -> None:
    users = {m for m, targets in graph.internal.items() if any(_in(t, TESTING) for t in targets)}
    assert sorted(u for u in users if not _in(u, TESTING) and not _in(u, LAB)) == []
    assert "kvgeom_lab.cluster" in users  # the lab's byte checks read the independent layout model


@pytest.mark.parametrize("name", [CORE, TESTING])
def test_the_facades_list_their_names_sorted_and_every_name_resolves(name: str) -> None:
    facade = importlib.import_module(name)
    names = list(facade.__all__)
    assert names == sorted(set(names))
    assert [n for n in names if not hasattr(facade, n)] == []


# -- the graph drawer itself -----------------------------------------------------------------------------
def _tree(root: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {"pkg": root / "pkg"}


def test_a_cycle_hidden_in_a_function_import_is_found(tmp_path: Path) -> None:
    pkgs = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .b import f\n",
            "pkg/b.py": "import importlib\n\ndef f():\n    return importlib.import_module('pkg.sub.c')\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "def g():\n    from .. import a\n    return a\n",
            "pkg/d.py": "import numpy\nfrom pkg import a\n",
        },
    )
    g = draw(pkgs)
    assert g.internal == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a"},
        "pkg.d": {"pkg.a"},
    }
    assert g.external["pkg.d"] == {"numpy", "pkg"}
    assert find_cycle(g.internal) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_an_acyclic_tree_has_no_cycle(tmp_path: Path) -> None:
    pkgs = _tree(
        tmp_path,
        {"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "x = 1\n", "pkg/b.py": "from . import a\n"},
    )
    g = draw(pkgs)
    assert g.internal == {"pkg": {"pkg.a"}, "pkg.a": set(), "pkg.b": {"pkg.a"}}
    assert find_cycle(g.internal) is None
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_the_test_folders_helper_modules_have_unique_names() -> None:
    """pytest imports a test folder's helper modules (``_ranks.py``) by their bare name, so two folders'
    helpers of one name shadow each other in a whole-suite run while each folder passes alone."""
    names: dict[str, list[str]] = {}
    for f in sorted((ROOT / "tests").rglob("_*.py")):
        if f.name != "__init__.py" and "mutants" not in f.parts:
            names.setdefault(f.name, []).append(str(f.relative_to(ROOT)))
    assert {n: paths for n, paths in names.items() if len(paths) > 1} == {}


#: where a compat mode may be read: the policy table (kvgeom.modes) and the drop-in for vLLM, which is the vLLM
#: boundary itself (it speaks vLLM's configuration, where the mode is a string)
MODE_READERS = ("kvgeom.modes", "kvgeom_vllm")
_MODE_NAMES = frozenset({"vllm", "kvgeom", "VLLM", "KVGEOM"})


def _reads_a_mode(node: ast.AST) -> bool:
    """A comparison of anything with a mode's spelling or a ``Compat`` member (``x == "vllm"``,
    ``x is Compat.KVGEOM``, ``x in ("vllm", ...)``)."""

    def is_mode(e: ast.AST) -> bool:
        if isinstance(e, ast.Constant) and e.value in ("vllm", "kvgeom"):
            return True
        if isinstance(e, ast.Attribute) and e.attr in _MODE_NAMES:
            return isinstance(e.value, ast.Name) and e.value.id == "Compat"
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(is_mode(x) for x in e.elts)
        return False

    return isinstance(node, ast.Compare) and any(is_mode(e) for e in (node.left, *node.comparators))


def mode_reads(graph: Graph) -> list[str]:
    """``module:line`` of every comparison with a mode outside :data:`MODE_READERS`."""
    found = []
    for module, path in sorted(graph.files.items()):
        if any(_in(module, m) for m in MODE_READERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _reads_a_mode(node):
                found.append(f"{module}:{node.lineno}")  # type: ignore[attr-defined]
    return found


def test_only_the_policy_table_reads_the_compat_mode(graph: Graph) -> None:
    """Every stage reads :class:`kvgeom.modes.Policy` fields; the mode's name is compared in one module."""
    assert mode_reads(graph) == []


def test_a_stage_comparing_the_mode_is_found(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "kvgeom/__init__.py": "",
            "kvgeom/modes.py": "def policy_of(c):\n    return c == 'vllm'\n",
            "kvgeom/plan/__init__.py": "",
            "kvgeom/plan/request.py": "def f(p):\n    a = p.compat == 'kvgeom'\n    return a or p.x is Compat.VLLM\n",
            "kvgeom/plan/bind.py": "def g(p):\n    return p.policy.by_tokens and p.mode == 'pull'\n",
        },
    )
    assert mode_reads(draw({CORE: tmp_path / CORE})) == ["kvgeom.plan.request:2", "kvgeom.plan.request:3"]
