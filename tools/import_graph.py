"""Print hslite's import graph: packages, file-level cycles and package-level cycles.

Every import counts — module-level, inside a function (lazy) and under ``TYPE_CHECKING`` — because each is a
dependency a reader has to hold in mind, and a lazy cycle is still a cycle. ``python tools/import_graph.py`` prints
the package graph, the cycles (none, when the layout is healthy) and the largest files; ``--check`` exits 1 when
there is a cycle. ``tests/test_layout.py`` runs the same scan.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hslite"


@dataclass(frozen=True)
class Layout:
    """The modules of one package tree and the imports between them."""

    files: dict[str, Path]
    edges: dict[str, set[str]]

    def unit(self, module: str) -> str:
        """The package a module belongs to: ``hslite.X`` for a subpackage or a top-level module, and ``hslite.X.Y``
        inside a package of stages (``hslite.preflight_check.measure``), so the stages' order is checked too."""
        parts = module.split(".")
        depth = 3 if len(parts) >= 4 or (len(parts) == 3 and self.files[module].name == "__init__.py") else 2
        return ".".join(parts[:depth])

    def unit_edges(self) -> dict[str, set[str]]:
        """Edges between packages (a package importing itself is not an edge)."""
        graph: dict[str, set[str]] = {self.unit(m): set() for m in self.files}
        for src, targets in self.edges.items():
            for target in targets:
                if self.unit(target) != self.unit(src):
                    graph[self.unit(src)].add(self.unit(target))
        return graph


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The hslite modules one import statement loads (``from pkg import sub`` loads ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    if not isinstance(node, ast.ImportFrom):
        return
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            yield f"{base}.{alias.name}"
        elif base in known:
            yield base


def scan(root: Path = ROOT) -> Layout:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    edges: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in imported_modules(node, module, path.name == "__init__.py", known):
                if target != module and not module.startswith(target + "."):
                    edges[module].add(target)
    return Layout(files, edges)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def report(layout: Layout) -> list[str]:
    lines = ["packages (imports of any kind, lazy and type-only included):"]
    for unit, targets in sorted(layout.unit_edges().items()):
        short = sorted(t.removeprefix("hslite.") for t in targets)
        lines.append(f"  {unit.removeprefix('hslite.'):<26} -> {', '.join(short) or '(nothing of hslite)'}")
    file_cycles = cycles(layout.edges)
    package_cycles = cycles(layout.unit_edges())
    lines.append(f"file cycles: {len(file_cycles)}")
    lines += [f"  {' <-> '.join(c)}" for c in file_cycles]
    lines.append(f"package cycles: {len(package_cycles)}")
    lines += [f"  {' <-> '.join(c)}" for c in package_cycles]
    top = [m for m, p in layout.files.items() if p.parent == ROOT]
    lines.append(f".py files directly under hslite/: {len(top)}")
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in layout.files.items()), reverse=True)
    lines.append("largest files: " + ", ".join(f"{m.removeprefix('hslite.')} {n}" for n, m in sizes[:3]))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when any cycle is found")
    args = parser.parse_args(argv)
    layout = scan()
    print("\n".join(report(layout)))
    return 1 if args.check and (cycles(layout.edges) or cycles(layout.unit_edges())) else 0


if __name__ == "__main__":
    raise SystemExit(main())
