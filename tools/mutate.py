"""A small AST mutator: how many wrong versions of a module does the test suite notice?

Usage::

    python tools/mutate.py relay/core/fingerprint.py -t tests/core/test_fingerprint.py [-t ...]
        [--only 3,17] [--per-mutant-s 120] [--work /tmp/mutants] [--list] [--lua]

Each mutant changes one thing in the module: a comparison flipped (``==``/``!=``, ``<``/``>=``,
``is``/``is not``, ``in``/``not in``), ``and``/``or`` swapped, a ``not`` dropped, an integer
constant moved by one, ``True``/``False`` swapped, a short string constant (at most 3
characters: separators, prefixes) emptied, ``+``/``-`` swapped, or a call statement, ``raise``,
``+=``, ``break`` or ``continue`` deleted. Docstrings, annotations and long strings (log and
error texts, regular expressions) are left alone.

With ``--lua`` only the Lua scripts are mutated: the string constants assigned to module-level
names ending in ``_LUA``. Each mutant changes one thing in one script: ``==``/``~=`` flipped,
``>=``/``<`` flipped, ``and``/``or`` swapped, a ``not`` dropped, a value tag swapped (``'P|``
with ``'D|``, ``'S|`` with ``'U|``), ``return 1``/``return 0`` swapped, or a line that is a
``redis.call(...)`` statement deleted.

The repository is copied to ``--work`` (never edited in place: others work in the tree); each
mutant is written there and the given test files run with ``pytest -x`` under a per-mutant time
limit (a timeout counts as killed). Prints one line per surviving mutant and the score; exits 0.
Run it niced (``nice -n 19``): it is CPU-bound for minutes.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_FLIP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE,
    ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_DELETABLE = (ast.Expr, ast.Raise, ast.AugAssign, ast.Break, ast.Continue)
# Lua: (pattern, replacement, description); each match is one mutant
_LUA_EDITS: tuple[tuple[str, str | None, str], ...] = (
    (r"==", "~=", "== -> ~="), (r"~=", "==", "~= -> =="),
    (r">=", "<", ">= -> <"), (r"(?<![=~<>])<(?!=)", ">=", "< -> >="),
    (r"\band\b", "or", "and -> or"), (r"\bor\b", "and", "or -> and"),
    (r"\bnot ", "", "drop not"),
    (r"'P\|", "'D|", "tag P -> D"), (r"'D\|", "'P|", "tag D -> P"),
    (r"'S\|", "'U|", "tag S -> U"), (r"'U\|", "'S|", "tag U -> S"),
    (r"\breturn 1\b", "return 0", "return 1 -> 0"), (r"\breturn 0\b", "return 1", "return 0 -> 1"),
    (r"(?m)^[ \t]*redis\.call\(.*\n", None, "delete redis.call line"),
)


@dataclass(frozen=True)
class Mutant:
    """One mutation site: its index, line and what it changes."""

    index: int
    line: int
    what: str


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _annotation_ids(tree: ast.AST) -> set[int]:
    """ids of every node inside an annotation (never mutated)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        roots: list[ast.AST | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots.append(node.returns)
            args = node.args
            roots += [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            roots += [a.annotation for a in (args.vararg, args.kwarg) if a is not None]
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        for root in roots:
            if root is not None:
                out.update(id(n) for n in ast.walk(root))
    return out


def _sites(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Every (node, description) that one mutation can change, in a fixed order."""
    skip = _annotation_ids(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for op in node.ops:
                yield node, f"{type(op).__name__} -> {_FLIP[type(op)].__name__}"
        elif isinstance(node, ast.BoolOp):
            yield node, "and <-> or"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "drop not"
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            yield node, "+ <-> -"
        elif isinstance(node, ast.Constant) and _constant_mutable(node.value):
            yield node, f"constant {node.value!r}"
        elif isinstance(node, _DELETABLE) and not _is_docstring(node):
            yield node, f"delete {type(node).__name__}"


def _constant_mutable(value: object) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return True
    return isinstance(value, (str, bytes)) and 0 < len(value) <= 3


def _mutate(node: ast.AST, what: str, op_index: int) -> ast.AST:
    """The replacement of ``node`` for mutation ``what``."""
    if isinstance(node, ast.Compare):
        ops = list(node.ops)
        ops[op_index] = _FLIP[type(ops[op_index])]()
        return ast.Compare(left=node.left, ops=ops, comparators=node.comparators)
    if isinstance(node, ast.BoolOp):
        return ast.BoolOp(op=ast.Or() if isinstance(node.op, ast.And) else ast.And(),
                          values=node.values)
    if isinstance(node, ast.UnaryOp):
        return node.operand
    if isinstance(node, ast.BinOp):
        return ast.BinOp(left=node.left, right=node.right,
                         op=ast.Sub() if isinstance(node.op, ast.Add) else ast.Add())
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            return ast.Constant(not value)
        if isinstance(value, int):
            return ast.Constant(value + 1)
        if isinstance(value, (str, bytes)):
            return ast.Constant(value[:0])
        return node
    return ast.Pass()


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.AST, replacement: ast.AST) -> None:
        self.target, self.replacement = target, replacement

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return self.replacement
        return super().generic_visit(node)


def mutants(source: str) -> list[tuple[Mutant, str]]:
    """Every mutant of ``source``: (description, mutated source)."""
    out: list[tuple[Mutant, str]] = []
    original = ast.unparse(ast.parse(source))
    count = len(list(_sites(ast.parse(source))))
    for index in range(count):
        tree = ast.parse(source)  # a fresh tree per mutant
        sites = list(_sites(tree))
        node, what = sites[index]
        op_index = sum(1 for other, _ in sites[:index] if other is node)
        new_tree = _Replace(node, _mutate(node, what, op_index)).visit(tree)
        text = ast.unparse(ast.fix_missing_locations(new_tree))
        if text != original:
            out.append((Mutant(index, getattr(node, "lineno", 0), what), text))
    return out


def lua_mutants(source: str) -> list[tuple[Mutant, str]]:
    """Every Lua mutant of ``source`` (the ``_LUA`` constants): (description, mutated source)."""
    out: list[tuple[Mutant, str]] = []
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.endswith("_LUA")):
            continue
        name = node.targets[0].id
        for const in ast.walk(node.value):
            if not (isinstance(const, ast.Constant) and isinstance(const.value, str)):
                continue
            start, end = _offsets(lines, const)
            literal = source[start:end]  # a triple-quoted literal: its text is the script's
            for pattern, replacement, what in _LUA_EDITS:
                for match in re.finditer(pattern, literal):
                    new = literal[:match.start()] + (replacement or "") + literal[match.end():]
                    line = const.lineno + literal.count("\n", 0, match.start())
                    mutant = Mutant(len(out), line, f"{name}: {what}")
                    out.append((mutant, source[:start] + new + source[end:]))
    return out


def _offsets(lines: list[str], node: ast.expr) -> tuple[int, int]:
    """The character offsets of ``node`` in the source split into ``lines``."""
    def at(lineno: int | None, col: int | None) -> int:
        assert lineno is not None and col is not None
        before = "".join(lines[: lineno - 1])
        return len(before) + len(lines[lineno - 1].encode()[:col].decode())
    return at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)


def _prepare(work: Path) -> None:
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(REPO, work, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".hypothesis",
        "mutants"))


def _run_tests(work: Path, tests: list[str], limit_s: float) -> bool:
    """True when the tests fail (the mutant is killed)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-p", "no:randomly", *tests]
    try:
        done = subprocess.run(cmd, cwd=work, capture_output=True, timeout=limit_s, check=False)
    except subprocess.TimeoutExpired:
        return True
    return done.returncode != 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module")
    parser.add_argument("-t", "--tests", action="append", required=True)
    parser.add_argument("--only", default="")
    parser.add_argument("--per-mutant-s", type=float, default=120.0)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "relay-mutants"))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--lua", action="store_true", help="mutate the _LUA string constants")
    args = parser.parse_args()
    source = (REPO / args.module).read_text()
    found = lua_mutants(source) if args.lua else mutants(source)
    only = {int(i) for i in args.only.split(",") if i}
    if only:
        found = [(m, text) for m, text in found if m.index in only]
    if args.list:
        for m, _ in found:
            print(f"#{m.index} line {m.line}: {m.what}")
        print(f"{len(found)} mutants")
        return
    work = Path(args.work)
    _prepare(work)
    target = work / args.module
    if _run_tests(work, args.tests, args.per_mutant_s * 3):
        sys.exit("the tests fail on the unmutated module: fix that first")
    killed = 0
    started = time.monotonic()
    try:
        for m, text in found:
            target.write_text(text)
            if _run_tests(work, args.tests, args.per_mutant_s):
                killed += 1
                print(f"killed #{m.index} line {m.line}: {m.what}", flush=True)
            else:
                print(f"SURVIVED #{m.index} line {m.line}: {m.what}", flush=True)
    finally:
        target.write_text(source)
    total = len(found)
    print(f"{args.module}: killed {killed} of {total} mutants "
          f"({100 * killed / max(total, 1):.1f} %) in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
