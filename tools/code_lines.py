"""Counts a Python file's own code: the lines that hold code, leaving out blank lines, comments,
docstrings and tests (functions named test_*, with their decorators).

    python tools/code_lines.py 05-warp-specialized-conv.py common.py

This is how the series budgets a chapter (lesson 05: about 600 lines of its own code).
"""
import ast
import io
import sys
import tokenize
from pathlib import Path


def _docstring_lines(tree) -> set:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _test_lines(tree) -> set:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines.update(range(first, node.end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """The number of lines of `source` that hold code (not comments, docstrings or tests)."""
    tree = ast.parse(source)
    left_out = _docstring_lines(tree) | _test_lines(tree)
    with_code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                          tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        with_code.update(range(token.start[0], token.end[0] + 1))
    return len(with_code - left_out)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        text = Path(name).read_text()
        print(f"{name}: {code_lines(text)} lines of code, {len(text.splitlines())} lines in all")
