"""The import graph of every project package (the folders pyproject.toml lists), imports inside functions included:
no cycle between files or between packages, and the layers the images rely on."""

from __future__ import annotations

import ast
import functools
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the operator image ships (Dockerfile): nothing there may import a package the image lacks.
OPERATOR_IMAGE = {"diloco_operator", "diloco_kube", "diloco_chaos", "diloco_trainer"}


def project_modules() -> dict[str, Path]:
    """Module name -> file, for every package under the folders pyproject.toml's packages.find lists."""
    where = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    mods = {}
    for folder in where:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    prefix = node.module or ""
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    return [prefix] + [f"{prefix}.{a.name}" for a in node.names]


@functools.cache
def project_graph() -> dict[str, frozenset[str]]:
    """The import graph of every project module, parsed once per test session."""
    return {m: frozenset(ts) for m, ts in import_graph(project_modules()).items()}


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Edges module -> project modules it imports anywhere in its file (top level or inside a function)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(m, path, node):
                    # a module importing its own package's __init__ is not a cycle worth reporting
                    if t in mods and t != m and not m.startswith(t + "."):
                        edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    pkgs: dict[str, set[str]] = {}
    for m, targets in edges.items():
        pkgs.setdefault(m.split(".")[0], set()).update(t.split(".")[0] for t in targets)
    return {p: ts - {p} for p, ts in pkgs.items()}


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions():
    edges = project_graph()
    # learner/main.py imports the learner loop only inside a function (torch stays out of `diloco --help`)
    assert "diloco_trainer.learner.loop" in edges["diloco_trainer.learner.main"]


def test_no_import_cycle_between_files():
    found = cycles(project_graph())
    assert not found, "file import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_between_packages():
    found = cycles(package_graph(project_graph()))
    assert not found, "package import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_kubernetes_layer_imports_no_other_project_package():
    assert package_graph(project_graph())["diloco_kube"] == set()


def test_the_operator_image_packages_import_nothing_the_image_lacks():
    pkgs = package_graph(project_graph())
    for pkg in OPERATOR_IMAGE:
        assert pkgs[pkg] <= OPERATOR_IMAGE, f"{pkg} imports {sorted(pkgs[pkg] - OPERATOR_IMAGE)}"


def folder_graph(edges: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The import graph between the role folders (and top-level modules) of one package."""
    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])
    out: dict[str, set[str]] = {}
    for m, targets in edges.items():
        if m.startswith(package + "."):
            out.setdefault(folder(m), set()).update(folder(t) for t in targets if t.startswith(package + "."))
    return {f: ts - {f} for f, ts in out.items()}


def test_no_import_cycle_between_the_operators_role_folders():
    found = cycles(folder_graph(project_graph(), "diloco_operator"))
    assert not found, "operator folder cycles: " + "; ".join(" <-> ".join(c) for c in found)


PURE_OPERATOR_FOLDERS = ("diloco_operator.api", "diloco_operator.plan", "diloco_operator.objects")
IO = ("kopf", "aiohttp", "kubernetes", "diloco_kube.client", "diloco_operator.reconcile", "diloco_operator.remote",
      "diloco_operator.handlers", "asyncio", "socket", "subprocess")


def test_the_operators_pure_folders_import_no_io():
    mods = project_modules()
    for m, path in mods.items():
        if not m.startswith(PURE_OPERATOR_FOLDERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(m, path, node):
                    assert not any(t == io or t.startswith(io + ".") for io in IO), f"{m} imports {t}"
