"""Every public class says what it owns and its contract (issue 17; STYLE.md section 1).

Checked on the source text (ast), like tests/test_architecture.py: a class defined at module
level in src/refit whose name does not start with an underscore has a non-empty docstring.
Whether the docstring states lifecycle, what must agree and what may change between calls is
for review; this test only keeps a public class from having none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "refit"
FILES = sorted(PKG.rglob("*.py"))


def _module_level(body: list[ast.stmt]) -> list[ast.ClassDef]:
    """Classes of a module body, including those under a module-level ``if`` or ``try``."""
    out: list[ast.ClassDef] = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            out.append(node)
        elif isinstance(node, ast.If):
            out += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _module_level(node.body) + _module_level(node.orelse) + _module_level(node.finalbody)
            for handler in node.handlers:
                out += _module_level(handler.body)
    return out


def undocumented_classes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{c.name} (line {c.lineno})"
        for c in _module_level(tree.body)
        if not c.name.startswith("_") and not (ast.get_docstring(c) or "").strip()
    ]


def test_the_check_sees_classes():
    assert FILES and any(_module_level(ast.parse(p.read_text()).body) for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_public_classes_have_docstrings(path: Path):
    missing = undocumented_classes(path)
    assert not missing, f"{path.relative_to(PKG.parent)}: public classes without a docstring: {', '.join(missing)}"
