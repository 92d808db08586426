"""The shape of the code, checked: imports go one way (kernels <- transfer <- actors <- cluster <- deploy;
bench may import anything, nothing imports bench; `ferry bench` comes in through an entry point), no import circle between files of actors/, cluster/, deploy/ or bench/ (type-only
imports count: a circle is a circle), every class name is defined once, and no module of the serving
packages grows past 400 lines (split by noun when one does)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "transfer", "actors", "cluster", "deploy")  # lowest first
MAX_LINES = 400


def modules(*folders: str) -> dict[str, Path]:
    out = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imported(path: Path) -> set[str]:
    """Every absolute module name `path` imports, anywhere in the file (with `from m import n`,
    both `m` and `m.n`, since `n` may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_imports_go_one_way() -> None:
    wrong = []
    for name, path in modules(*PACKAGES).items():
        level = PACKAGES.index(name.split(".")[0])
        for target in imported(path):
            top = target.split(".")[0]
            if top == "bench" or top in PACKAGES and PACKAGES.index(top) > level:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_import_circles() -> None:
    mods = modules("actors", "cluster", "deploy", "bench")
    # a module's own parent packages are not edges: `from pkg import submodule` names pkg, but it is the
    # submodule that is used, and a package's __init__ re-exporting its modules is not a circle of design
    graph = {name: {t for t in imported(path) if t in mods and t != name and not name.startswith(t + ".")}
             for name, path in mods.items()}
    assert not cycles(graph), "\n".join(" -> ".join(c) for c in cycles(graph))


def test_every_class_name_is_defined_once() -> None:
    where = collections.defaultdict(list)
    for name, path in modules(*PACKAGES, "bench").items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    twice = {cls: mods for cls, mods in where.items() if len(mods) > 1}
    assert not twice, twice


def test_no_module_grows_past_the_limit() -> None:
    long = {name: n for name, path in modules(*PACKAGES, "bench/sim").items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long
