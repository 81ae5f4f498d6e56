"""Mutation operators for tools/mutate.py: find every one-token fault in a module and apply one.

A mutant is a span of the source (start/end line and column of one AST node) and the text that
replaces it. The replacement is the mutated node unparsed and spliced into the original text, so
the rest of the file (comments, formatting, line numbers) is untouched and a traceback of the
mutant points at the real line.

Operators (the faults a one-line slip makes; strings and None are left alone):
- arithmetic ``+ - * / // % **`` and bitwise ``& | << >>`` swapped (also in ``x op= y``)
- comparisons: ``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not in``
- ``and``/``or`` swapped; ``not x`` -> ``x``; ``-x`` -> ``x``
- an ``if`` condition that is not a comparison negated
- ``True``/``False`` swapped; a number ``n`` -> ``n + 1`` (``1`` -> ``0``)
- ``return x`` -> ``return None``
- a statement that only calls something (``foo(x)``), a ``raise``, or an assignment to an
  attribute or item (``self.x = y``) replaced by ``pass``

Lines carrying ``# pragma: no mutate`` are skipped, and so are annotations, f-strings, docstrings
and ``__all__``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses

_BINOP_SWAP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_CMP_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_SYMBOL = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    path: str  # relative to the repository root
    line: int
    col: int
    end_line: int
    end_col: int
    replacement: str
    operator: str  # e.g. "+ -> -", "delete call"
    stmt_line: int = 0  # first line of the enclosing statement (coverage reports that line)

    @property
    def ident(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.operator}"

    def apply(self, source: str) -> str:
        """The module's source with this mutant's span replaced."""
        lines = source.splitlines(keepends=True)
        head = lines[self.line - 1][: self.col]
        tail = lines[self.end_line - 1][self.end_col :]
        middle = head + self.replacement + tail
        return "".join(lines[: self.line - 1]) + middle + "".join(lines[self.end_line :])

    def original(self, source: str) -> str:
        lines = source.splitlines(keepends=True)[self.line - 1 : self.end_line]
        if len(lines) == 1:
            return lines[0][self.col : self.end_col]
        return lines[0][self.col :] + "".join(lines[1:-1]) + lines[-1][: self.end_col]


def _skipped_fields(node: ast.AST) -> set[str]:
    """Fields of ``node`` whose subtrees are not mutated (annotations)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {"returns", "decorator_list"}
    if isinstance(node, ast.arg):
        return {"annotation"}
    if isinstance(node, ast.AnnAssign):
        return {"annotation"}
    return set()


def _is_docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_dunder_all(node: ast.AST) -> bool:
    return isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == "__all__"
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    )


def _walk(node: ast.AST, parent: ast.AST | None = None, stmt: ast.AST | None = None):
    """Yield (node, parent, enclosing statement) for every node that may be mutated."""
    if isinstance(node, ast.JoinedStr) or _is_dunder_all(node):
        return
    if _is_docstring(node, parent):
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        return
    if isinstance(node, ast.stmt):
        stmt = node
    yield node, parent, stmt
    skip = _skipped_fields(node)
    for name, value in ast.iter_fields(node):
        if name in skip:
            continue
        children = value if isinstance(value, list) else [value]
        for child in children:
            if isinstance(child, ast.AST):
                yield from _walk(child, node, stmt)


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _expr(node: ast.AST) -> str:
    return "(" + ast.unparse(node) + ")"


def _number_mutation(value):
    if isinstance(value, bool):
        return (not value), f"{value} -> {not value}"
    if isinstance(value, int):
        new = 0 if value == 1 else value + 1
        return new, f"{value} -> {new}"
    if isinstance(value, float):
        new = 0.0 if value == 1.0 else value + 1.0
        return new, f"{value} -> {new}"
    return None, None


def _mutations_of(node: ast.AST, parent: ast.AST | None):
    """(replacement text, operator name) for each mutant of ``node`` alone."""
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BINOP_SWAP:
        new = copy.deepcopy(node)
        new.op = _BINOP_SWAP[type(node.op)]()
        text = ast.unparse(new) if isinstance(node, ast.AugAssign) else _expr(new)
        yield text, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[type(new.op)]}"
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMP_SWAP:
                new = copy.deepcopy(node)
                new.ops[i] = _CMP_SWAP[type(op)]()
                yield _expr(new), f"{_SYMBOL[type(op)]} -> {_SYMBOL[type(new.ops[i])]}"
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield _expr(new), "and -> or" if isinstance(node.op, ast.And) else "or -> and"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        name = "not x -> x" if isinstance(node.op, ast.Not) else "-x -> x"
        yield _expr(node.operand), name
    elif isinstance(node, ast.Constant) and not isinstance(parent, ast.UnaryOp):
        value, name = _number_mutation(node.value)
        if name is not None:
            yield repr(value), name
    elif isinstance(node, ast.Return) and node.value is not None:
        if not (isinstance(node.value, ast.Constant) and node.value.value is None):
            yield "return None", "return -> return None"
    elif isinstance(node, ast.Expr) and isinstance(node.value, (ast.Call, ast.Await)):
        yield "pass", "delete call"
    elif isinstance(node, ast.Raise):
        yield "pass", "delete raise"
    elif isinstance(node, ast.Assign) and all(
        isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets
    ):
        yield "pass", "delete store"
    if isinstance(node, (ast.If, ast.IfExp, ast.While)) and not isinstance(
        node.test, (ast.Compare, ast.UnaryOp)
    ):
        yield ("test", _expr(ast.UnaryOp(op=ast.Not(), operand=node.test))), "negate condition"


def mutants_of(path: str, source: str) -> list[Mutant]:
    """Every mutant of one module, in source order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for node, parent, stmt in _walk(tree):
        for replacement, operator in _mutations_of(node, parent):
            target = node
            if isinstance(replacement, tuple):  # the mutation replaces a child (the condition)
                target = getattr(node, replacement[0])
                replacement = replacement[1]
            if "pragma: no mutate" in lines[target.lineno - 1]:
                continue
            found.append(
                Mutant(
                    path,
                    target.lineno,
                    target.col_offset,
                    target.end_lineno,
                    target.end_col_offset,
                    replacement,
                    operator,
                    stmt.lineno if stmt is not None else target.lineno,
                )
            )
    return [m for m in found if _compiles(m.apply(source))]


def _compiles(source: str) -> bool:
    try:
        compile(source, "<mutant>", "exec")
    except SyntaxError:
        return False
    return True
