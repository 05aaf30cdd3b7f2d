"""Which zygote a call is forked from.

Forking (and later tearing down) a process with numpy/sympy/scipy loaded costs several times
more than forking a bare interpreter (page tables of ~70 MB of heap, ~400 mappings). Most tool
calls are small scripts using `math` or `itertools`; those go to the "lean" zygote. Anything
that might import something heavy — or import dynamically — goes to the "heavy" one, so a
wrong guess only costs time (a lean sandbox can still import sympy, just slowly), never
correctness.
"""
from __future__ import annotations

import re

from .code_judge import embedded_code

HEAVY, LEAN = "heavy", "lean"

# Cheap to import and preloaded in the lean zygote.
LEAN_MODULES = frozenset(
    """__future__ abc array bisect builtins cmath collections copy dataclasses datetime decimal
    enum fractions functools heapq io itertools json math numbers operator os pprint random re
    string struct sys textwrap time typing""".split()
)
_IMPORT_WORD = re.compile(r"\bimport\b")
_SIMPLE_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(?P<from>[A-Za-z_][\w.]*)[ \t]+import[ \t]+[\w., \t()*]+"
    r"|import[ \t]+(?P<mods>[\w.]+(?:[ \t]+as[ \t]+\w+)?(?:[ \t]*,[ \t]*[\w.]+(?:[ \t]+as[ \t]+\w+)?)*))"
    r"[ \t]*(?:#.*)?$"
)
_DYNAMIC = ("__import__", "importlib", "exec(", "eval(", "compile(", "runpy", "pickle", "load_module")


def imported_modules(line: str) -> list[str] | None:
    """Top-level module names of a simple import line, or None if the line is not one."""
    m = _SIMPLE_IMPORT.match(line)
    if m is None:
        return None
    if m.group("from"):
        return [m.group("from").split(".")[0]]
    return [part.strip().split()[0].split(".")[0] for part in m.group("mods").split(",")]


def choose_tier(code: str) -> str:
    """The zygote for `code`; a code-judge wrapper (env/code_judge.wrap_program) goes where the
    model's code inside it would go (its own imports are preloaded everywhere: sandbox.py's)."""
    inner = embedded_code(code)
    if inner is not None:
        code = inner
    if any(token in code for token in _DYNAMIC):
        return HEAVY
    for line in code.splitlines():
        if not _IMPORT_WORD.search(line):
            continue
        mods = imported_modules(line)
        if mods is None or any(mod not in LEAN_MODULES for mod in mods):
            return HEAVY
    return LEAN
