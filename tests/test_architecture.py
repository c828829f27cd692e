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


def _import_graph(imports=None) -> dict[str, set[str]]:
    """Each module -> the modules importing it runs, as Python runs them: importing `ffnquant.a.b` from outside
    the package `a` first runs `ffnquant/a/__init__.py`, so that package is an edge too (whatever its `__init__`
    imports is then reached through it). The package root is left out (`from .. import __version__`)."""
    imports = imports or _imports
    modules = _modules()
    graph = {}
    for m, p in modules.items():
        direct = imports(m, p, modules) - {"ffnquant"}
        packages = {".".join(t.split(".")[:i]) for t in direct for i in range(2, t.count(".") + 1)}
        graph[m] = direct | {pkg for pkg in packages if pkg in modules and pkg != m and not m.startswith(pkg + ".")}
    return graph


def test_no_import_cycles_in_the_package():
    """Modules that import each other (even lazily, inside functions, or through a package's `__init__`) have no
    layering: each must have a direction."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_sees_a_loop_through_a_package_init():
    """The loop the check once missed: `methods/__init__` importing the handlers, which stand on the AWQ search,
    which reads `schemes`, which imports `methods.registry`: importing that runs `methods/__init__` first."""
    def eager(name, path, modules):
        return _imports(name, path, modules) | ({"ffnquant.methods.builtin"} if name == "ffnquant.methods" else set())

    assert any({"ffnquant.methods", "ffnquant.schemes"} <= set(c) for c in _cycles(_import_graph(eager)))


# The subpackages, lowest first: each may import the ones before it, never one after it (lazy imports included).
# Kernels run tensors; runtimes run kernels and torch; hf is the engine on a real model; deploy writes a planned
# model; planning chooses recipes (asking deploy what a format stores); report renders; pipeline is the main job;
# commands parse and print. The loose top-level modules sit below all of them, except the few that build on one
# (TOP_LEVEL_ABOVE).
SUBPACKAGE_ORDER = ("kernels", "runtimes", "hf", "deploy", "planning", "report", "pipeline", "commands")
# Subpackages of the core, at the level of the loose modules: they and the loose modules import each other freely
# (no cycle between modules), and they import none of the ordered subpackages above.
CORE_SUBPACKAGES = ("infra", "numerics", "methods", "measure", "onnx")  # lowest first (test_the_core_is_ordered)


def _subpackage_edges(imports=None) -> dict[tuple[str, str], list[str]]:
    """{(importer subpackage, imported subpackage): the importing modules}, between different subpackages
    (`imports`: a module's imports, `_imports` by default)."""
    imports = imports or _imports
    modules = _modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for m, p in modules.items():
        parts = m.split(".")
        if len(parts) < 3 and not (len(parts) == 2 and p.name == "__init__.py"):
            continue  # a top-level module
        src = parts[1]
        for t in imports(m, p, modules):
            tp = t.split(".")
            if len(tp) >= 2 and (tp[1] in SUBPACKAGE_ORDER) and tp[1] != src and (len(tp) > 2 or modules[t].name == "__init__.py"):
                edges.setdefault((src, tp[1]), []).append(m)
    return edges


def test_the_subpackages_are_layered():
    """Every subpackage is in the order, and no subpackage imports one above it: the package has a direction a
    newcomer can read bottom-up, not only no cycle between single modules."""
    actual = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    known = set(SUBPACKAGE_ORDER) | set(CORE_SUBPACKAGES)
    assert actual == known, f"add {sorted(actual - known)} to SUBPACKAGE_ORDER or CORE_SUBPACKAGES"
    rank = {**{name: -1 for name in CORE_SUBPACKAGES}, **{name: i for i, name in enumerate(SUBPACKAGE_ORDER)}}
    upward = {f"{a} -> {b}": sorted(set(who)) for (a, b), who in _subpackage_edges().items() if rank[b] > rank[a]}
    assert not upward, f"subpackages importing one above them: {upward}"


def test_the_core_is_ordered():
    """The core subpackages have a direction too: infra (files, checks) < numerics (the math) < methods (the
    handlers and the torch reference on them) < measure (timing) < onnx (writers, which time their artifacts). A
    core subpackage imports none after it (through a package's `__init__` too)."""
    modules = _modules()
    rank = {name: i for i, name in enumerate(CORE_SUBPACKAGES)}

    def sub(m: str) -> str | None:
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and modules[m].name == "__init__.py") else None

    upward = sorted(f"{m} -> {t}" for m, targets in _import_graph().items() for t in targets
                    if sub(m) in rank and sub(t) in rank and rank[sub(t)] > rank[sub(m)])
    assert not upward, upward


# Top-level modules that build on a subpackage, with the highest one each may import: they sit just above it, so
# only subpackages above that one may import them (everything else top-level is below every subpackage).
TOP_LEVEL_ABOVE = {"bench": "runtimes", "adequacy": "hf", "api": "pipeline", "wholemodel": "report"}


def test_top_level_modules_sit_below_or_just_above_their_subpackages():
    modules = _modules()
    rank = {name: i for i, name in enumerate(SUBPACKAGE_ORDER)}
    top = {m.split(".")[1]: (m, p) for m, p in modules.items() if m.count(".") == 1 and p.name != "__init__.py"}
    wrong = []
    for short, (m, p) in top.items():
        used = {t.split(".")[1] for t in _imports(m, p, modules) if t.count(".") >= 1 and t.split(".")[1] in rank}
        allowed = TOP_LEVEL_ABOVE.get(short)
        if used and (allowed is None or max(rank[u] for u in used) > rank[allowed]):
            wrong.append(f"{m} imports {sorted(used)} (declared: {allowed})")
    for m, p in modules.items():
        if m.count(".") < 2 and p.name != "__init__.py":
            continue
        for t in _imports(m, p, modules):
            short = t.split(".")[1] if t.count(".") == 1 else None
            if short in TOP_LEVEL_ABOVE and rank[m.split(".")[1]] <= rank[TOP_LEVEL_ABOVE[short]]:
                wrong.append(f"{m} imports {t}, which builds on {TOP_LEVEL_ABOVE[short]}")
    assert not wrong, wrong


def test_the_layering_check_sees_an_upward_import():
    def with_upward(name, path, modules):  # a kernel module importing the main job: what the order forbids
        return _imports(name, path, modules) | ({"ffnquant.pipeline.job"} if name == "ffnquant.kernels.tritonenv" else set())

    assert ["ffnquant.kernels.tritonenv"] == _subpackage_edges(with_upward)[("kernels", "pipeline")]
    assert ("kernels", "pipeline") not in _subpackage_edges()


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
LARGE_MODULES: dict[str, str] = {}  # path -> why it may go to 700 lines (none needs it now)


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


def test_comments_explain_the_code_not_the_tracker():
    """No comment or docstring cites the tracker ('the issue', 'issue 3'): each says what the code means, which
    stays true when the tracker is gone."""
    pattern = re.compile(r"\bthe issue\b|\bissue \d+|\bissue's\b", re.I)
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not bad, f"comments citing the tracker: {bad}"
