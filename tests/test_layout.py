"""The house's layout rules, checked on the tree: no import cycles, a small top floor, files a reader can hold.

The scan is tools/import_graph.py's (every import counts: lazy and type-only ones too), so what this test enforces is
what `python tools/import_graph.py` prints.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_TOP_LEVEL_FILES = 11  # docs/design.md, layout: roles live in folders; the top floor keeps API, CLI, leaf helpers
MAX_LINES = 300


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_cycle_of_files_or_packages():
    graph = _import_graph()
    layout = graph.scan()
    assert graph.cycles(layout.edges) == []
    assert graph.cycles(layout.unit_edges()) == []


def test_the_scan_sees_lazy_and_type_only_imports(tmp_path):
    package = tmp_path / "hslite"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from hslite.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hslite import a\n"
    )
    graph = _import_graph()
    layout = graph.scan(package)
    assert graph.cycles(layout.edges) == [["hslite.a", "hslite.sub.b"]]
    assert graph.cycles(layout.unit_edges()) == [["hslite.a", "hslite.sub"]]


def test_datasets_and_models_depend_on_no_layer_above_them():
    edges = _import_graph().scan().unit_edges()
    above = ("hslite.parallel", "hslite.preflight_check", "hslite.recipe", "hslite.run", "hslite.comparison")
    above += ("hslite.task",)
    for layer in ("hslite.datasets", "hslite.models", "hslite.task"):
        assert {unit for unit in edges[layer] if unit.startswith(above)} == set(), layer


def test_the_preflight_stages_import_only_the_stages_before_them():
    edges = _import_graph().scan().unit_edges()
    order = ["measure", "hardware", "price", "decide", "own_script"]
    for i, stage in enumerate(order):
        later = {f"hslite.preflight_check.{s}" for s in order[i + 1 :]}
        assert edges[f"hslite.preflight_check.{stage}"] & later == set(), stage


def test_the_top_floor_is_small():
    top = sorted(p.name for p in (REPO / "hslite").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_FILES, top


def test_no_folder_holds_more_than_12_files_directly():
    """A folder of more files is split by role into subpackages (docs/design.md, layout)."""
    folders = [REPO / "hslite", *(path for path in (REPO / "hslite").rglob("*") if path.is_dir())]
    sizes = {str(folder.relative_to(REPO)): len([f for f in folder.glob("*.py") if f.name != "__init__.py"])
             for folder in folders}  # fmt: skip
    assert {folder: n for folder, n in sizes.items() if n > 12} == {}


def test_no_file_is_over_300_lines():
    long = [f"{path.relative_to(REPO)}: {n} lines" for path in sorted((REPO / "hslite").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES]  # fmt: skip
    assert long == []


def test_code_and_readme_cite_only_what_the_repository_holds():
    """Design notes outside the repository, private documents and issue numbers are not citable: a reader cannot open
    them. The design the code stands on is docs/design.md."""
    unopenable = re.compile(r"DESIGN §|DESIGN\.md|\b[Ss]eed 00\d|the seeds'|\b[Ii]ssue \d+")
    sources = [*REPO.glob("hslite/**/*.py"), *REPO.glob("benchmarks/**/*.py"), *REPO.glob("recipes/*.yaml")]
    cited = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in [*sources, REPO / "README.md"]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if unopenable.search(line)
    ]
    assert cited == []
    assert (REPO / "docs" / "design.md").is_file()
