"""Every module of megastart holds one idea and every function reads on a page: a module over
350 lines or a function over 80 is two ideas waiting to be split (issue 50), not one to trim."""

from __future__ import annotations

import ast
from pathlib import Path

import megastart
import megastart.hooks

MODULE_LINES = 350
FUNCTION_LINES = 80
ROOTS = (Path(megastart.__file__).parent, Path(megastart.hooks.__file__).parent)


def sources() -> list[Path]:
    return sorted(path for root in ROOTS for path in root.rglob("*.py"))


def test_no_module_is_over_350_lines() -> None:
    long = {
        str(path): lines
        for path in sources()
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_80_lines() -> None:
    long = {
        f"{path}:{node.lineno} {node.name}": length
        for path in sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > FUNCTION_LINES
    }
    assert long == {}
