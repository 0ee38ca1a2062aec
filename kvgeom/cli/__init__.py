"""``kvgeom`` command line: explain, check, plan and draw a P/D pair; list models and examples; run the demo.

A pair is a scenario file (JSON: ``model``, ``prefill``, ``decode``, ``mode``, ``compat``; or the name of
a shipped example, see ``kvgeom examples``), and/or flags that override it:
``--model nemotron-h-8b --prefill tp=2,block=auto --decode tp=1,block=2080``.

Exit status: 0 the pair works (or the command succeeded), 1 kvgeom refuses the pair (the reason is
printed), 2 bad input (one line naming the field and what is accepted), 70 an internal error (a bug: one
line; ``KVGEOM_DEBUG=1`` shows the traceback). ``--json`` prints one JSON
object instead of text (schema: docs/cli.md). No input ever ends in a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvgeom import __version__
from kvgeom.cli._commands import COMMANDS, Refused, demo_hint
from kvgeom.cli._inputs import WIDTH, UsageError, field_for_cli
from kvgeom.errors import KvgeomError, PlanError

__all__ = ["main", "SCHEMA_VERSION"]

#: version of the ``--json`` output (docs/cli.md); bumped when a field changes meaning or goes away
SCHEMA_VERSION = 1

_PAIR_HELP = {
    "scenario": "scenario JSON file, or the name of a shipped example (kvgeom examples lists them); flags "
    "below override its fields",
    "--model": "a preset name or its Hugging Face id (kvgeom models lists them), or the path of a Hugging Face "
    "config.json (or of its directory)",
    "--prefill": "P engine as key=value pairs: tp=2,block=auto,min_block=16,kernel=16,align=16,blocks=64,"
    "layout=head_major,conv=DS,split=false (docs/cli.md)",
    "--decode": "D engine, same keys as --prefill",
    "--mode": "pull: D reads from P (default); push: P writes to D",
    "--compat": "kvgeom: plan what kvgeom proves safe (default); vllm: do exactly what vLLM 0.33.0 does",
    "--kv-cache-dtype": "attention cache dtype (vLLM's --kv-cache-dtype); auto: the model's dtype",
    "--ssm-cache-dtype": "SSM temporal-state dtype (vLLM's --mamba-ssm-cache-dtype); auto: the model family's "
    "rule",
}


class _Parser(argparse.ArgumentParser):
    """An argparse parser that raises :class:`UsageError` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        field = self.prog.split(" ", 1)[-1] if " " in self.prog else "arguments"
        if message.startswith("argument "):
            name, _, message = message[len("argument ") :].partition(": ")
            field = name.split("/")[-1]
        elif message.startswith("the following arguments are required: "):
            field = message.split(": ", 1)[1]
        raise UsageError(field, message.rstrip("."), f"see {self.prog} --help")


def _pair_args(p: argparse.ArgumentParser, demo: bool = False) -> None:
    from kvgeom.model.hfconfig import KV_CACHE_DTYPES, SSM_CACHE_DTYPES

    p.add_argument(
        "scenario",
        nargs="?",
        help=_PAIR_HELP["scenario"]
        + (" (default: the demo's built-in Mamba2 hybrid, P TP2 -> D TP1)" if demo else ""),
    )
    p.add_argument("--model", help=_PAIR_HELP["--model"])
    p.add_argument("--prefill", metavar="K=V,...", help=_PAIR_HELP["--prefill"])
    p.add_argument("--decode", metavar="K=V,...", help=_PAIR_HELP["--decode"])
    p.add_argument("--mode", choices=("pull", "push"), help=_PAIR_HELP["--mode"])
    p.add_argument("--compat", choices=("kvgeom", "vllm"), help=_PAIR_HELP["--compat"])
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help=_PAIR_HELP["--kv-cache-dtype"])
    p.add_argument("--ssm-cache-dtype", choices=SSM_CACHE_DTYPES, help=_PAIR_HELP["--ssm-cache-dtype"])


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON object (schema version {SCHEMA_VERSION}, docs/cli.md) instead of text",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvgeom",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Exit status: 0 ok, 1 the pair is refused, 2 bad input. docs/cli.md has the details.",
    )
    parser.add_argument(
        "--version", action="version", version=f"kvgeom {__version__}", help="print kvgeom's version and exit"
    )
    sub = parser.add_subparsers(
        dest="cmd",
        required=True,
        metavar="COMMAND",
        parser_class=_Parser,
        help="what to do (kvgeom COMMAND --help for its options)",
    )
    _list_commands(sub)
    _pair_commands(sub)
    _demo_command(sub)
    return parser


def _list_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``models`` and ``examples``: what ships with kvgeom."""
    p = sub.add_parser(
        "models",
        help="list the model presets (name, Hugging Face id, layers, TP sizes)",
        description="List the shipped model presets.",
    )
    _json_arg(p)
    p = sub.add_parser(
        "examples",
        help="list the shipped example scenarios and where they are installed",
        description="List the shipped example scenarios.",
    )
    _json_arg(p)


def _pair_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``explain``, ``check``, ``plan`` and ``draw``: a pair, and for the last two a request."""
    texts = {
        "explain": "print both engines' rank geometry",
        "check": "check the pair at handshake, rank by rank",
        "plan": "plan one request and print it",
        "draw": "draw which P bytes land where on every D rank",
    }
    for name, text in texts.items():
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        _pair_args(p)
        _json_arg(p)
        if name in ("plan", "draw"):
            p.add_argument(
                "--tokens",
                default="100",
                help="request length in tokens (default 100; at most what both pools hold)",
            )
        if name == "plan":
            _plan_args(p)
        if name == "draw":
            _draw_args(p)


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seed",
        default=None,
        help="draw block ids at random from the pools with this seed (default: sequential ids)",
    )
    p.add_argument("--moves", default="0", help="print the first N byte moves of each rank (default 0)")
    p.add_argument(
        "--rank",
        default=None,
        help="plan only this local rank (D rank in pull, P rank in push; default: every rank)",
    )


def _draw_args(p: argparse.ArgumentParser) -> None:
    lo, hi = WIDTH
    p.add_argument(
        "--width",
        default="64",
        help=f"characters per block in the text picture ({lo}..{hi}, default 64)",
    )
    p.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="write a picture to FILE (.png or .svg; needs "
        "the plot extra: pip install 'kvgeom[plot]'); default: text on stdout",
    )
    p.add_argument(
        "--format",
        choices=("text", "png", "svg"),
        help="picture format (default: from --output's suffix, else text)",
    )


def _demo_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``demo``: a real NIXL transfer of a pair's requests, every byte verified."""
    p = sub.add_parser(
        "demo",
        help="run a real NIXL transfer between P and D processes and verify every byte "
        "(needs the nixl extra)",
        description="Run a real NIXL transfer between P and D processes "
        "and verify every byte against the oracle (needs pip install 'kvgeom[nixl]').",
    )
    _pair_args(p, demo=True)
    _json_arg(p)
    p.add_argument(
        "--tokens",
        nargs="+",
        default=None,
        help="request lengths in tokens, one request each (default: 97 1000 2500 31 4096 640 1777 64)",
    )
    p.add_argument("--progress-thread", action="store_true", help="enable NIXL's progress thread")
    p.add_argument(
        "--timeout", default="300", help="bound of the whole run in seconds (1..3600, default 300)"
    )


def _emit_error(exc: KvgeomError, kind: str, as_json: bool, cmd: str | None, flags: dict[str, bool]) -> int:
    field = field_for_cli(exc.field, flags)
    if isinstance(exc, PlanError) and exc.field == "num_tokens":
        field = "--tokens"
    message = str(exc).split(": ", 1)[-1] if str(exc).startswith(f"{exc.field}: ") else str(exc)
    if kind == "usage" and "(accepted: " not in message:
        message += f" (accepted: see kvgeom {cmd + ' ' if cmd else ''}--help and docs/cli.md)"
    status = 1 if kind == "refused" else 2
    label = "refused" if kind == "refused" else "error"
    print(f"kvgeom: {label}: {field}: {message}".replace("\n", " "), file=sys.stderr)
    if as_json:
        print(
            json.dumps(
                {
                    "schema_version": SCHEMA_VERSION,
                    "kvgeom_version": __version__,
                    "command": cmd,
                    "ok": False,
                    "exit_status": status,
                    "error": {
                        "kind": kind,
                        "type": type(exc).__name__,
                        "field": field,
                        "message": message,
                        "accepted": getattr(exc, "accepted", None),
                    },
                }
            )
        )
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 refused, 2 bad input)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args_list
    cmd = next((a for a in args_list if not a.startswith("-")), None)
    flags = {side: f"--{side}" in args_list for side in ("prefill", "decode")}
    try:
        args = build_parser().parse_args(args_list)
        fn: Callable[[argparse.Namespace], dict[str, Any]] = COMMANDS[args.cmd]
        out = fn(args)
    except UsageError as exc:
        return _emit_error(exc, "usage", as_json, cmd, flags)
    except Refused as exc:
        return _emit_error(exc.error, "refused", as_json, cmd, flags)
    except KvgeomError as exc:
        return _emit_error(exc, "usage", as_json, cmd, flags)
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("kvgeom: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print(
            "kvgeom: error: memory: the pair needs more memory than this machine has (accepted: smaller pools, "
            "--prefill/--decode blocks=N)",
            file=sys.stderr,
        )
        return 2
    # a bug in kvgeom: one line and a distinct status (KVGEOM_DEBUG=1 shows the traceback)
    except Exception as exc:
        if os.environ.get("KVGEOM_DEBUG"):
            raise
        print(
            f"kvgeom: internal error: {type(exc).__name__}: {exc} (please report it; KVGEOM_DEBUG=1 shows the "
            "traceback)".replace("\n", " "),
            file=sys.stderr,
        )
        return 70
    status = int(out.pop("exit_status", 0))
    text = out.pop("text", "")
    try:
        if as_json:
            print(
                json.dumps(
                    {
                        "schema_version": SCHEMA_VERSION,
                        "kvgeom_version": __version__,
                        "command": args.cmd,
                        "ok": status == 0,
                        "exit_status": status,
                        **out,
                    }
                )
            )
        elif text:
            print(text)
    except BrokenPipeError:
        sys.stderr.close()
    return status


__all__ += ["build_parser", "demo_hint"]
