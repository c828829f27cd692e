"""The package's shape: no import cycles (checked over the import graph, function-level imports included),
recipes parsed once per command, module sizes, and docs/ARCHITECTURE.md's module map against the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ffnquant"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ffnquant module `name` imports anywhere in its file (lazy imports inside functions too)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # imports for type annotations only never run: they are not edges of the import graph
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and isinstance(block.test, ast.Name)
                   and block.test.id == "TYPE_CHECKING" for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "ffnquant":
                target = node.module
            else:
                continue
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == "ffnquant"]
        for t in targets:
            while t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_package():
    """Modules that import each other (even lazily, inside functions) have no layering: each must have a
    direction. Importing the package root (`from .. import __version__`) from a submodule is allowed."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) - {"ffnquant"} for m, p in modules.items()}
    assert _cycles(graph) == []


def test_a_run_parses_each_recipe_once(tmp_path, recipe_parses):
    """Recipe text is parsed when the config is made; the stages pass Recipe objects, never text."""
    from ffnquant.pipeline import RunConfig, run

    config = RunConfig.tiny(variants=("swiglu",), runtimes=("none",), sensitivity=False,
                            out_reports=str(tmp_path / "r"), out_export=str(tmp_path / "e"))
    assert len(recipe_parses) == len(config.recipes) + 1  # each text of the config once: the schemes, the baseline
    recipe_parses.clear()
    run(config)
    assert recipe_parses == []


# Modules allowed past 600 lines (never past 700), each one cohesive thing (docs/ARCHITECTURE.md says why).
LARGE_MODULES = {
    "ffnquant/kernels/w4a16.py": "the Triton kernels with their tuner, launcher and module (packing is in w4a16_pack)",
}


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")), ids=str)
def test_module_size(path):
    n = len((ROOT / path).read_text(encoding="utf-8").splitlines())
    limit = 700 if path in LARGE_MODULES else 600
    assert n <= limit, f"{path} has {n} lines (limit {limit}); split it by concern or list it in LARGE_MODULES with why"


def test_the_module_map_in_docs_matches_the_package():
    """docs/ARCHITECTURE.md lists every top-level module and subpackage of ffnquant, and nothing else."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(ffnquant/[\w/.]+)` \|", text, flags=re.M))
    actual = {f"ffnquant/{p.name}" for p in PACKAGE.glob("*.py")}
    actual |= {f"ffnquant/{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert listed == actual, f"missing from the map: {sorted(actual - listed)}; not in the package: {sorted(listed - actual)}"
    for path, why in LARGE_MODULES.items():
        assert path.removeprefix("ffnquant/").split("/")[-1] in text, f"the map must say why {path} may be large"
