"""The order test files are handed to pytest-xdist's workers: longest first.

`make test` runs two workers with `--dist loadfile` (each file whole on one worker). xdist's own
order puts the files with the most tests first, so the few-but-long files (the multi-node cluster,
the recovery bench) start among the last; whether one worker then runs alone at the end depends on
the durations (on this box, replaying them through both orders gives the same finish). Handing out
the longest files first (and `--no-loadscope-reorder`, so xdist keeps this order) leaves only short
files for the end, whatever the durations are.

A file's length is its seconds in tests/file_durations.json, measured on a full run here; a file
not listed there is estimated from its markers. Refresh the list after a full run with
`make test PYTEST_ARGS="--junitxml=/tmp/junit.xml"` and then
`.venv/bin/python -m tests.file_order /tmp/junit.xml`.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("file_durations.json")
ROOT = DURATIONS.parent.parent  # node ids and junit class names are relative to it

# Estimated seconds per test for a file the durations list does not know yet.
SLOW_TEST_S = 20.0
RAY_TEST_S = 3.0
PLAIN_TEST_S = 0.2


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def estimate(item: pytest.Item) -> float:
    if item.get_closest_marker("slow") is not None:
        return SLOW_TEST_S
    if item.get_closest_marker("ray") is not None:
        return RAY_TEST_S
    return PLAIN_TEST_S


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_files_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """The items grouped by file, the files by length (longest first, ties by path); each file's own
    tests keep their order."""
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[_file_of(item)].append(item)

    def length(path: str) -> float:
        known = durations.get(path)
        return known if known is not None else sum(estimate(i) for i in by_file[path])

    ordered = sorted(by_file, key=lambda path: (-length(path), path))
    return [item for path in ordered for item in by_file[path]]


def durations_from_junit(junit_xml: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown) from a pytest --junitxml report."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "")
        # classname is the dotted module, plus the class for tests in a class.
        parts = module.split(".")
        while parts and not (ROOT / Path(*parts).with_suffix(".py")).exists():
            parts.pop()
        if parts:
            seconds[str(Path(*parts).with_suffix(".py"))] += float(case.get("time", 0.0))
    return {path: round(s, 1) for path, s in sorted(seconds.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.file_order JUNIT_XML", file=sys.stderr)
        return 2
    durations = durations_from_junit(Path(argv[0]))
    if not durations:
        print(f"no test cases of this checkout's files in {argv[0]}", file=sys.stderr)
        return 1
    DURATIONS.write_text(json.dumps(durations, indent=1) + "\n")
    print(f"{len(durations)} files, {sum(durations.values()):.0f} s in all -> {DURATIONS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
