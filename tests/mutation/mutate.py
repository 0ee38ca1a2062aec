"""Mutation testing of kvgeom with mutmut (``make mutate``, ``make mutate-ci``).

mutmut (configured in ``pyproject.toml`` ``[tool.mutmut]``) writes every mutant of ``kvgeom/`` into
``mutants/`` and runs, for each, the tests of the fast derandomized selection that reach the mutated
function (unit, golden, testing, property at the ``mutate`` hypothesis profile), stopping at the first
failure. This script chooses which mutants to run and scores them:

* ``--sample N``: N mutants per area (``core`` = ``kvgeom/*``, ``oracle`` = the byte oracle in
  ``kvgeom/testing/``), drawn reproducibly (``--seed``) from the eligible ones. The whole population
  (about 17,000 mutants) takes days on 2 cores, so the score is the score of a uniform sample, reported
  with its 95% interval. ``--all`` runs every eligible mutant of the chosen ``--modules``.
* ``--ci``: the CI sample: ``CI_PER_MODULE`` mutants of each of the most important modules, picked by a
  hash of their mutated code (stable while the code is); fails if one survives.

Eligible: not a change of prose only (a string literal with a space in it: error messages, docstrings,
whose wording no test pins on purpose), and not listed in ``equivalents.json`` or ``equivalents/*.json``
(mutants that cannot change behaviour, each with a one-line reason; matched by function and mutated line,
so they survive renumbering). ``--write-docs`` puts the score table into ``docs/testing.md`` between its markers.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EQUIVALENTS = HERE / "equivalents.json"
#: more equivalents, one file per area of the code (same format), so parallel work does not collide
EQUIVALENTS_DIR = HERE / "equivalents"
DOC = ROOT / "docs" / "testing.md"
EQUIVALENTS_DOC = ROOT / "docs" / "mutation-equivalents.md"
MUTMUT = [sys.executable, "-m", "mutmut"]

#: the most important modules: the CI sample draws from each of them
CI_MODULES = (
    "plan.request",
    "pair.tp",
    "plan.descids",
    "blocks",
    "pair.handshake",
    "pair.route",
    "plan.align",
    "testing._oracle",
)
CI_PER_MODULE = 3
#: the CI sample's tests: the ones that exercise planning end to end (bounded stats collection)
CI_TESTS = [
    "tests/golden",
    "tests/property",
    "tests/testing/test_oracle_catches_bugs.py",
    "tests/testing/test_oracle_csa_linear.py",
    "tests/testing/test_oracle_permute.py",
    "tests/testing/test_oracle_shared_rows.py",
    "tests/testing/test_oracle_parts.py",
    "tests/testing/test_nixl_double.py",
    "tests/testing/test_strategies.py::test_testing_strategies_is_loaded_on_first_access",
    # the unit tests of every stage (tests/unit/<stage>/ mirrors kvgeom/<stage>/), the foundations' and the
    # cross-stage values; not the CLI, drawing, packaging or docs tests
    "tests/unit/test_blocks.py",
    "tests/unit/test_core_values.py",
    "tests/unit/model",
    "tests/unit/layout",
    "tests/unit/pair",
    "tests/unit/plan",
    "tests/unit/compat",
    "tests/unit/tools/test_scenario.py",
]
#: modules of each area (strategies generate the tests' inputs: their mutants weaken tests, not kvgeom)
ORACLE = (
    "testing.oracle",
    "testing._oracle",
    "testing._coords",
    "testing._layout",
    "testing._report",
    "testing._request",
    "testing.nixl_double",
    "testing._nixl_values",
)
NOT_SCORED = ("testing.strategies", "testing._pairs", "testing.__init__", "__init__")

#: mutmut exit codes: 1/3 a test failed; 36, +-24, 152, 255 timed out (the mutant made the tests hang: a
#: kill); 0 every test passed, 5/33 no test reaches the mutant (both survivors)
KILLED = (1, 3, 36, 24, -24, 152, 255)
SURVIVED = (0, 5, 33)


@dataclass(frozen=True)
class Mutant:
    name: str  # mutmut's key, e.g. kvgeom.plan.request.x_plan_request__mutmut_12
    module: str  # e.g. plan, testing.oracle
    function: str  # e.g. x_plan_request
    before: str  # the original line(s) the mutant changes, stripped
    after: str  # the mutated line(s), stripped

    @property
    def area(self) -> str:
        return "oracle" if self.module in ORACLE else "core"


def _module_of(name: str) -> tuple[str, str]:
    left, _, _ = name.rpartition("__mutmut_")
    parts = left.split(".")
    return ".".join(parts[1:-1]), parts[-1]


def _changed(diff: str) -> tuple[str, str]:
    minus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(minus), " / ".join(plus)


def _tokens(code: str) -> list[tuple[int, str]]:
    """The tokens of a few source lines (possibly an unclosed bracket: tokens up to the end)."""
    skip = (
        tokenize.NEWLINE,
        tokenize.NL,
        tokenize.ENDMARKER,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.COMMENT,
    )
    out = []
    try:
        for t in tokenize.generate_tokens(io.StringIO(code).readline):
            if t.type not in skip:
                out.append((t.type, t.string))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def _is_prose(tok: tuple[int, str]) -> bool:
    strings = {
        tokenize.STRING,
        *(
            getattr(tokenize, n)
            for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
            if hasattr(tokenize, n)
        ),
    }
    return tok[0] in strings and " " in tok[1]


def prose_only(before: str, after: str) -> bool:
    """Whether the mutant only rewrites, drops or replaces by ``None`` a string literal that holds prose
    (has a space): the text of an error message or a docstring."""
    a, b = _tokens(before.replace(" / ", "\n")), _tokens(after.replace(" / ", "\n"))
    if not a:
        return False
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not ops:
        return False
    for _, i1, i2, j1, j2 in ops:
        gone, new = a[i1:i2], b[j1:j2]
        if not any(_is_prose(t) for t in gone) and not any(_is_prose(t) for t in new):
            return False
        if not all(_is_prose(t) or t[1] == "," for t in gone):
            return False
        if not all(_is_prose(t) or t[1] in (",", "None") for t in new):
            return False
    return True


def _diff(orig: str, mutant: str) -> tuple[str, str]:
    """The changed lines of a mutant against its original function."""
    a, b = orig.splitlines(), mutant.splitlines()
    minus, plus = [], []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op != "equal":
            minus += [ln.strip() for ln in a[i1:i2]]
            plus += [ln.strip() for ln in b[j1:j2]]
    return " / ".join(minus), " / ".join(plus)


def load_mutants() -> list[Mutant]:
    """Every generated mutant (``mutants/**/*.py.meta``) with its changed lines, read through mutmut's
    line-span index of the generated files."""
    os.chdir(ROOT)
    from mutmut.mutation.data import MutantLineSpans

    out = []
    for meta in sorted((ROOT / "mutants" / "kvgeom").rglob("*.py.meta")):
        keys = json.loads(meta.read_text())["exit_code_by_key"]
        rel = meta.relative_to(ROOT / "mutants").with_suffix("")
        spans = MutantLineSpans.load(rel)
        if spans is None or not keys:
            continue
        lines = (ROOT / "mutants" / rel).read_text().splitlines()

        def text(fn: str, spans: MutantLineSpans = spans, lines: list[str] = lines) -> str:
            span = spans.span_by_function_name[fn]
            return "\n".join(lines[span.start - 1 : span.end])

        for name in keys:
            module, function = _module_of(name)
            local = name.rpartition(".")[2]
            orig = local.rpartition("__mutmut_")[0] + "__mutmut_orig"
            try:
                before, after = _diff(text(orig), text(local).replace(local + "(", orig + "("))
            except KeyError:
                continue  # not in the index: not scored
            out.append(Mutant(name, module, function, before, after))
    return out


def load_equivalents() -> list[dict[str, str]]:
    out = list(json.loads(EQUIVALENTS.read_text())["equivalents"])
    for path in sorted(EQUIVALENTS_DIR.glob("*.json")):
        out += json.loads(path.read_text())["equivalents"]
    return out


def _function_sources(module: str) -> dict[str, list[str]]:
    """Every function of core module ``module`` (``"plan.request"``) by its mutmut name (``x_name``,
    ``xǁClassǁmethod``), as its stripped source lines; empty if the module is gone."""
    import ast

    path = ROOT / "kvgeom" / (module.replace(".", "/") + ".py")
    if not path.exists():
        return {}
    text = path.read_text()
    lines = text.splitlines()
    out: dict[str, list[str]] = {}

    def body(node: ast.AST) -> list[str]:
        return [x.strip() for x in lines[node.lineno - 1 : node.end_lineno]]  # type: ignore[attr-defined]

    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[f"x_{node.name}"] = body(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"xǁ{node.name}ǁ{item.name}"] = body(item)
    return out


def _holds(source: list[str], before: str) -> bool:
    """Whether some consecutive stripped lines of ``source``, joined as :func:`_diff` joins them, are
    ``before`` (a line may itself hold " / ", so every count of lines up to the separators' is tried)."""
    for n in range(1, before.count(" / ") + 2):
        if any(" / ".join(source[i : i + n]) == before for i in range(len(source) - n + 1)):
            return True
    return False


def stale_equivalents(entries: list[dict[str, str]]) -> list[tuple[dict[str, str], str | None]]:
    """Recorded equivalents whose function no longer holds their mutated line (the code moved or is gone),
    each with the one function of the same module that now holds it (``None``: none, or several)."""
    cache: dict[str, dict[str, list[str]]] = {}
    out = []
    for e in entries:
        funcs = cache.setdefault(e["module"], _function_sources(e["module"]))
        if _holds(funcs.get(e["function"], []), e["before"]):
            continue
        holders = [name for name, src in funcs.items() if _holds(src, e["before"])]
        out.append((e, holders[0] if len(holders) == 1 else None))
    return out


def fix_stale() -> int:
    """``--fix-stale``: re-key each stale equivalent to the one function that now holds its line, drop those
    whose line is gone, print both; the reasons are kept (review them: a moved line may sit in new context)."""
    files = [EQUIVALENTS, *sorted(EQUIVALENTS_DIR.glob("*.json"))]
    for path in files:
        data = json.loads(path.read_text())
        stale = {id(e): new for e, new in stale_equivalents(data["equivalents"])}
        kept = []
        for e in data["equivalents"]:
            if id(e) not in stale:
                kept.append(e)
            elif stale[id(e)] is None:
                print(f"dropped {e['module']}.{e['function']}: {e['before']}")
            else:
                print(f"re-keyed {e['module']}.{e['function']} -> {stale[id(e)]}: {e['before']}")
                kept.append({**e, "function": stale[id(e)]})
        if len(kept) != len(data["equivalents"]) or any(id(e) in stale for e in data["equivalents"]):
            data["equivalents"] = kept
            path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    EQUIVALENTS_DOC.write_text(equivalents_doc(load_equivalents()))
    return 0


def is_equivalent(m: Mutant, equivalents: list[dict[str, str]]) -> dict[str, str] | None:
    for e in equivalents:
        if (
            e["module"] == m.module
            and e["function"] == m.function
            and e["before"] == m.before
            and e["after"] == m.after
        ):
            return e
    return None


def eligible(mutants: list[Mutant], equivalents: list[dict[str, str]]) -> list[Mutant]:
    return [
        m
        for m in mutants
        if m.module not in NOT_SCORED
        and not prose_only(m.before, m.after)
        and is_equivalent(m, equivalents) is None
    ]


def _stable_key(m: Mutant) -> str:
    return hashlib.sha256(f"{m.module}|{m.function}|{m.before}|{m.after}".encode()).hexdigest()


def ci_sample(pool: list[Mutant]) -> list[Mutant]:
    chosen = []
    for module in CI_MODULES:
        mine = sorted((m for m in pool if m.module == module), key=_stable_key)
        if len(mine) < CI_PER_MODULE:
            raise SystemExit(f"mutate: module {module} has only {len(mine)} eligible mutants")
        chosen += mine[:CI_PER_MODULE]
    return chosen


def _mutmut(args: list[str], ci: bool) -> list[str]:
    """The command running mutmut with ``args``; for the CI sample, with the configuration narrowed to the
    CI modules and tests (mutmut reads ``[tool.mutmut]``; the override is applied before it starts)."""
    if not ci:
        return [*MUTMUT, *args]
    only = [f"kvgeom/{m.replace('.', '/')}.py" for m in CI_MODULES]
    code = (
        "import sys\nfrom mutmut.configuration import config\ncfg = config()\n"
        f"cfg.only_mutate = {only!r}\ncfg.pytest_add_cli_args_test_selection = {CI_TESTS!r}\n"
        "from mutmut.__main__ import cli\n"
        f"sys.argv = ['mutmut', *{args!r}]\ncli()\n"
    )
    return [sys.executable, "-c", code]


def generate(ci: bool) -> None:
    """Write the mutants (mutmut's own generation step; cached while the sources are unchanged). The CI
    sample mutates only its modules: a ``mutants/`` left by the other kind of run is removed first, or
    mutmut would keep the other set (and report the sample's mutants as never run)."""
    kind = "ci" if ci else "all"
    marker = ROOT / "mutants" / ".kvgeom-kind"
    if (ROOT / "mutants").exists() and (not marker.exists() or marker.read_text() != kind):
        shutil.rmtree(ROOT / "mutants")
    code = (
        "from mutmut.configuration import config\n"
        + (
            f"config().only_mutate = {[f'kvgeom/{m.replace(chr(46), chr(47))}.py' for m in CI_MODULES]!r}\n"
            if ci
            else ""
        )
        + "from mutmut.__main__ import copy_src_dir, copy_also_copy_files, setup_source_paths, "
        "create_mutants, set_mutant_under_test\n"
        "set_mutant_under_test('mutant_generation')\n"
        "copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(2)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    marker.write_text(kind)


def results() -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for meta in (ROOT / "mutants" / "kvgeom").rglob("*.py.meta"):
        out.update(json.loads(meta.read_text())["exit_code_by_key"])
    return out


def run(names: list[str], max_children: int, ci: bool = False) -> dict[str, int | None]:
    """Run mutmut on ``names``; return each one's exit code (see ``KILLED`` / ``SURVIVED``)."""
    env = dict(os.environ, KVGEOM_HYPOTHESIS_PROFILE="mutate")
    for start in range(0, len(names), 400):  # bounded command lines
        batch = names[start : start + 400]
        subprocess.run(
            _mutmut(["run", "--max-children", str(max_children), *batch], ci),
            cwd=ROOT,
            env=env,
            check=False,
            stdout=subprocess.DEVNULL,
        )
    codes = results()
    return {n: codes.get(n) for n in names}


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def table(mutants: list[Mutant], codes: dict[str, int | None], populations: dict[str, int]) -> str:
    rows = [
        "| area | eligible mutants | run | killed | survived | not run / timeout | score | 95% interval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for area in ("core", "oracle"):
        mine = [m for m in mutants if m.area == area]
        killed = sum(codes.get(m.name) in KILLED for m in mine)
        survived = sum(codes.get(m.name) in SURVIVED for m in mine)
        other = len(mine) - killed - survived
        lo, hi = wilson(killed, killed + survived)
        score = killed / (killed + survived) if killed + survived else 0.0
        rows.append(
            f"| {area} | {populations.get(area, 0)} | {len(mine)} | {killed} | {survived} | {other} | "
            f"{score:.0%} | {lo:.0%}-{hi:.0%} |"
        )
    return "\n".join(rows)


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`" if text else "(nothing)"


def equivalents_doc(equivalents: list[dict[str, str]]) -> str:
    """``docs/mutation-equivalents.md``: every recorded equivalent mutant with its reason, by module."""
    by_module: dict[str, list[dict[str, str]]] = {}
    for e in equivalents:
        by_module.setdefault(e["module"], []).append(e)
    out = [
        "# Equivalent mutants",
        "",
        "Generated by `tests/mutation/mutate.py --write-docs` from `tests/mutation/equivalents.json` and",
        "`tests/mutation/equivalents/*.json`; do not edit by hand. Each entry is a mutant no input can tell",
        "apart from the original, left out of the mutation score (docs/testing.md), with the reason. They are",
        "matched by module, function and the mutated line, so they survive renumbering.",
        "",
        f"{len(equivalents)} entries: "
        + ", ".join(f"{m} {len(v)}" for m, v in sorted(by_module.items(), key=lambda kv: -len(kv[1])))
        + ".",
        "",
    ]
    for module in sorted(by_module):
        out += [
            f"## `{module}`",
            "",
            "| function | original | mutant | why equivalent |",
            "|---|---|---|---|",
        ]
        for e in sorted(by_module[module], key=lambda e: (e["function"], e["before"], e["after"])):
            fn = e["function"].removeprefix("x_").removeprefix("x\u01c1").replace("\u01c1", ".")
            out.append(
                f"| `{fn}` | {_cell(e['before'])} | {_cell(e['after'])} | {e['reason'].replace('|', '/')} |"
            )
        out.append("")
    return "\n".join(out)


def write_docs(text: str) -> None:
    EQUIVALENTS_DOC.write_text(equivalents_doc(load_equivalents()))
    doc = DOC.read_text()
    start, end = "<!-- mutation-score:start -->", "<!-- mutation-score:end -->"
    if start not in doc:
        raise SystemExit(f"mutate: {DOC} has no {start} marker")
    DOC.write_text(
        re.sub(re.escape(start) + r".*?" + re.escape(end), f"{start}\n{text}\n{end}", doc, flags=re.S)
    )


def rerun_survivors(
    mutants: list[Mutant], equivalents: list[dict[str, str]], max_children: int, write: bool
) -> int:
    """Run the survivors of the last sample again, found by module, function and mutated code (a source
    edit renumbers mutmut's mutants), and record their new results in ``mutants/last-run.json``."""
    path = ROOT / "mutants" / "last-run.json"
    last = json.loads(path.read_text())
    by_code = {(m.module, m.function, m.before, m.after): m.name for m in mutants}
    again = {}
    for name, d in last["mutants"].items():
        if d["exit"] in SURVIVED:
            now = by_code.get((d["module"], d["function"], d["before"], d["after"]))
            if now is None:
                print(f"mutate: {name} no longer exists (its code changed); dropped from the sample")
                d["exit"] = None
            else:
                again[name] = now
    codes = run(sorted(set(again.values())), max_children)
    for name, now in again.items():
        last["mutants"][name]["exit"] = codes.get(now)
    path.write_text(json.dumps(last, indent=1))
    return rescore(equivalents, write)


def rescore(equivalents: list[dict[str, str]], write: bool) -> int:
    last = json.loads((ROOT / "mutants" / "last-run.json").read_text())
    chosen = [
        Mutant(n, d["module"], d["function"], d["before"], d["after"]) for n, d in last["mutants"].items()
    ]
    chosen = [m for m in chosen if is_equivalent(m, equivalents) is None]
    codes = {n: d["exit"] for n, d in last["mutants"].items()}
    text = table(chosen, codes, last["populations"])
    print(text)
    for m in chosen:
        if codes.get(m.name) in SURVIVED:
            print(f"SURVIVED {m.name}\n    - {m.before}\n    + {m.after}")
    if write:
        write_docs(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="the CI sample; exit 1 if one survives")
    ap.add_argument("--sample", type=int, default=0, help="mutants per area, drawn with --seed")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--all", action="store_true", help="every eligible mutant of --modules")
    ap.add_argument("--modules", nargs="*", default=None, help="e.g. plan testing.oracle (default: all)")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the chosen mutants and stop")
    ap.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="run the last run's survivors again (after adding tests), matched by their mutated code",
    )
    ap.add_argument(
        "--rescore",
        action="store_true",
        help="score the last run again (after recording equivalents), running nothing",
    )
    ap.add_argument(
        "--fix-stale",
        action="store_true",
        help="re-key recorded equivalents whose code moved to another function, drop those whose code is gone",
    )
    args = ap.parse_args(argv)

    if args.fix_stale:
        return fix_stale()
    equivalents = load_equivalents()
    if args.rescore:
        return rescore(equivalents, args.write_docs)
    generate(args.ci)
    mutants = load_mutants()
    if args.rerun_survivors:
        return rerun_survivors(mutants, equivalents, args.max_children, args.write_docs)
    pool = eligible(mutants, equivalents)
    if args.modules:
        pool = [m for m in pool if m.module in args.modules]
    populations = {a: sum(m.area == a for m in pool) for a in ("core", "oracle")}
    if args.ci:
        chosen = ci_sample(pool)
    elif args.all:
        chosen = pool
    else:
        rng = random.Random(args.seed)
        chosen = []
        for area in ("core", "oracle"):
            mine = sorted((m for m in pool if m.area == area), key=lambda m: m.name)
            chosen += rng.sample(mine, min(args.sample or 100, len(mine)))
    print(
        f"mutate: {len(mutants)} mutants, {len(pool)} eligible "
        f"({populations['core']} core, {populations['oracle']} oracle); running {len(chosen)}"
    )
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    - {m.before}\n    + {m.after}")
        return 0
    codes = run([m.name for m in chosen], args.max_children, args.ci)
    survivors = [m for m in chosen if codes.get(m.name) in SURVIVED]
    unknown = [m for m in chosen if codes.get(m.name) not in (*KILLED, *SURVIVED)]
    text = table(chosen, codes, populations)
    print(text)
    for m in survivors:
        print(f"SURVIVED {m.name}\n    - {m.before}\n    + {m.after}")
    for m in unknown:
        print(f"NOT KILLED (exit {codes.get(m.name)}) {m.name}\n    - {m.before}\n    + {m.after}")
    (ROOT / "mutants" / ("last-ci.json" if args.ci else "last-run.json")).write_text(
        json.dumps(
            {
                "populations": populations,
                "mutants": {
                    m.name: {
                        "module": m.module,
                        "function": m.function,
                        "exit": codes.get(m.name),
                        "before": m.before,
                        "after": m.after,
                    }
                    for m in chosen
                },
            },
            indent=1,
        )
    )
    if args.write_docs:
        write_docs(text)
    if args.ci and (survivors or unknown):
        print(f"mutate: {len(survivors) + len(unknown)} of {len(chosen)} CI mutants were not killed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
