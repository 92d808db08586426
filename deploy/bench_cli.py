"""`ferry bench serve ...`: the CLI face of the load generator in bench/loadgen.

The harness itself lives in bench/ (it runs against any OpenAI-compatible server); this module only
adds the subcommand; bench is imported when the parser is built or the command runs, never at module import.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: "argparse._SubParsersAction[Any]") -> None:
    """Adds `bench serve` to ferry's subparsers."""
    from bench.loadgen.cli import add_arguments

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_cmd", required=True)
    srv = bench.add_parser("serve", help="replay a trace against OpenAI-compatible servers; goodput, P99s, peers")
    add_arguments(srv)
    srv.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from bench.loadgen.cli import run_bench

    return run_bench(args)
