"""The project's shape, checked on its source: the layering ARCHITECTURE.md asks for (the core never imports
serve/, no import loop among the project's modules, the file-reading leaf imports nothing of the project) and no C
source held in Python strings (kernels are real .c/.h files)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# folder -> the package it is installed as (pyproject's package-dir)
PACKAGES = {"quantkit": "quantkit", "serve": "quantkit.serve", "kernels": "quantkit.kernels", "evals": "quantkit.evals"}
CORE = ("quantkit.quant", "quantkit.models", "quantkit.formats", "quantkit.kernels")
C_LINE_LIMIT = 20


def module_name(path: Path) -> str:
    """kernels/cpu/gemm.py -> quantkit.kernels.cpu.gemm; serve/__init__.py -> quantkit.serve."""
    parts = path.relative_to(REPO).with_suffix("").parts
    rest = [p for p in parts[1:] if p != "__init__"]
    return ".".join([PACKAGES[parts[0]], *rest])


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in PACKAGES for p in sorted((REPO / folder).rglob("*.py"))}


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in its body (function-level imports count: a lazy import is
    still a dependency). `from pkg import mod` counts as importing pkg and pkg.mod."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = project_modules()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def test_every_project_folder_is_read(graph):
    assert {"quantkit.quant.qlinear", "quantkit.serve.engine", "quantkit.kernels.cpu.gemm",
            "quantkit.kernels.triton.qgemm", "quantkit.evals.runner", "quantkit.files"} <= set(graph)
    assert "quantkit.files" in graph["quantkit.formats.checkpoint"]  # relative and lazy imports are seen too


def test_the_core_and_the_kernels_never_import_serve(graph):
    offending = {name: sorted(m for m in deps if m == "quantkit.serve" or m.startswith("quantkit.serve."))
                 for name, deps in graph.items() if name.startswith(CORE)}
    assert {k: v for k, v in offending.items() if v} == {}


def test_kernels_do_not_import_the_model_or_the_algorithms(graph):
    upward = ("quantkit.models", "quantkit.quant.qlinear", "quantkit.quant.calibrate", "quantkit.formats")
    offending = {name: sorted(m for m in deps if m.startswith(upward))
                 for name, deps in graph.items() if name.startswith("quantkit.kernels")}
    assert {k: v for k, v in offending.items() if v} == {}


def test_the_file_leaf_imports_nothing_of_the_project_but_the_error_type(graph):
    assert graph["quantkit.files"] <= {"quantkit.errors"}
    assert graph["quantkit.errors"] == set()


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (or a module importing itself), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    loops.append(sorted(component))
    return loops


def test_no_import_loop_among_the_project_modules(graph):
    assert strongly_connected(graph) == []


def test_the_loop_finder_finds_a_loop():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


# A line of C: a preprocessor directive, a statement or declaration ending in ';' with C punctuation, a brace
# line, or a C comment opener; counted only inside string constants.
C_PATTERN = re.compile(r"^\s*(#\s*(include|define|if|ifdef|ifndef|endif|else|pragma)\b|.*[;{}]\s*(/[*/].*)?$|/\*)")


def c_lines_in_strings(path: Path) -> int:
    count = 0
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            count += sum(bool(C_PATTERN.match(line)) for line in node.value.splitlines())
    return count


def test_no_c_source_inside_a_python_string():
    tops = [*PACKAGES, "bench", "tests", "recipes"]
    files = [p for top in tops if (REPO / top).is_dir() for p in (REPO / top).rglob("*.py")]
    files += [p for p in REPO.glob("*.py")]
    counts = {str(p.relative_to(REPO)): c_lines_in_strings(p) for p in files if p != Path(__file__)}
    heavy = {name: n for name, n in counts.items() if n > C_LINE_LIMIT}
    assert heavy == {}


def test_the_c_counter_counts_c(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('X = r"""\n#include <stdint.h>\nstatic int f(int a) {\n  return a + 1;\n}\n"""\n'
                     'Y = "plain prose, no code."\n')
    assert c_lines_in_strings(probe) == 4


def test_no_bench_script_shadows_an_installed_module():
    """`python bench/x.py` puts bench/ first on sys.path, so a script named like an installed top-level module
    (bench/kernels.py beside Hugging Face's `kernels`, which transformers imports) replaces it for every import."""
    import importlib.util
    import sys

    elsewhere = [p for p in sys.path if Path(p or ".").resolve() not in (REPO, REPO / "bench")]
    shadowing = [p.name for p in sorted((REPO / "bench").glob("*.py"))
                 if importlib.machinery.PathFinder.find_spec(p.stem, elsewhere) is not None
                 or p.stem in sys.builtin_module_names]
    assert not shadowing, shadowing
