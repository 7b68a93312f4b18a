"""The shape of the package: what a newcomer may rely on when reading or changing refit.

Checked on the source text (ast), so they hold without importing optional dependencies.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "refit"
MAX_FUNCTION_LINES = 80
MAX_EXECUTOR_LINES = 300
MAX_FILE_LINES = 700


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """refit modules that ``name`` imports (``from refit.x import y`` names refit.x.y if that is a module)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "refit"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "refit":
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in MODULES else mod)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_tool(name: str) -> bool:
    return name == "refit.tools" or name.startswith("refit.tools.")


def test_the_library_never_imports_its_tools():
    bad = {m: sorted(filter(_is_tool, deps)) for m, deps in GRAPH.items() if not _is_tool(m)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_import_cycle_between_modules():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_no_sys_path_edits_in_the_package():
    hits = [
        f"{p.relative_to(SRC)}:{i}"
        for p in MODULES.values()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "sys.path" in line
    ]
    assert hits == []


def test_no_function_longer_than_80_lines():
    long = []
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name}() is {n} lines")
    assert long == []


def _long_files(paths: list[Path], limit: int, root: Path) -> list[str]:
    """``"<path under root> has <n> lines"`` for each of ``paths`` longer than ``limit`` lines."""
    counts = {p: len(p.read_text().splitlines()) for p in paths}
    return [f"{p.relative_to(root)} has {n} lines" for p, n in counts.items() if n > limit]


def test_no_file_in_the_package_is_over_700_lines():
    """A file a reader can hold: past 700 lines a module holds more than one idea (split it by idea)."""
    long = _long_files(list(MODULES.values()), MAX_FILE_LINES, SRC.parent)
    assert long == [], f"files over {MAX_FILE_LINES} lines: " + "; ".join(long)


def test_the_file_length_check_names_a_long_file(tmp_path):
    """The check above sees a file over the limit, with its path and count, and passes one at the limit."""
    at, over = tmp_path / "at_limit.py", tmp_path / "over_limit.py"
    at.write_text("x = 1\n" * MAX_FILE_LINES)
    over.write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert _long_files([at, over], MAX_FILE_LINES, tmp_path) == [f"over_limit.py has {MAX_FILE_LINES + 1} lines"]


def test_the_executor_runs_steps_and_nothing_else():
    n = len((PKG / "executor.py").read_text().splitlines())
    assert n <= MAX_EXECUTOR_LINES, f"src/refit/executor.py has {n} lines (at most {MAX_EXECUTOR_LINES})"


@pytest.mark.parametrize("folder", ["layout", "plan", "transport", "quant", "engines", "trainers", "data", "tools"])
def test_the_folders_follow_the_flow_of_one_refit(folder):
    assert (PKG / folder / "__init__.py").is_file()


def test_the_checker_sees_a_cycle_and_a_tool_import():
    """The checks above are only as good as the import graph: it must see real edges."""
    assert "refit.executor" in GRAPH["refit.transfer"]
    assert "refit.tools.launch" in GRAPH["refit.tools.verify"]
    assert "refit.layout.tensors" in GRAPH["refit.layout"]  # a package's re-exports count
