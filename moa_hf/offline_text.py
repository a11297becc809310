"""Real text for the target to label, offline: the Python standard library's own source code and module docs.

`moa data --prompts default:stdlib` (``--responses keep`` by default) turns each record into a conversation whose
answer is real text the target did not write; nothing is generated: the drafter learns the target's next-token
distribution on that text (a distillation through the target's states, a prefill's cost per token). The answers are

- the whole source of each installed pure-Python stdlib module in runs of its lines of at most 2,400 characters,
  cut before top-level statements (a class longer than that is cut before its methods), asked for by a request
  naming the piece's first function or class;
- each module's docstring when it is longer than 200 characters (at most 3,000).

Modules of the ``default:pydoc`` target's material (`PYDOC_MODULES`, with their submodules) are left out, so its
held-out split stays unseen by a drafter trained on this text. Read with `ast` from the source files: nothing is
imported or executed. Deterministic for a given seed and Python version. Licence: PSF-2.0 (see PROMPTS.md).
"""

from __future__ import annotations

import ast
import random

from .offline_prompts import PYDOC_MODULES, read_source, stdlib_modules

__all__ = ["STDLIB_TEXT", "stdlib_text_records"]

STDLIB_TEXT = "default:stdlib"  # the conversation source of `stdlib_text_records`

_PIECE_CHARS = 2400
_MIN_PIECE_CHARS = 150
_MIN_DOC_CHARS, _MAX_DOC_CHARS = 200, 3000
_SOURCE_TEMPLATES = (
    "Show me how `{name}` is implemented in Python's `{module}` module.",
    "Write the Python code of `{name}` from the `{module}` module.",
    "What does the source of `{module}.{name}` look like?",
    "Implement `{name}` as Python's standard library `{module}` does.",
)
_DOC_TEMPLATES = (
    "Describe Python's `{module}` module in detail.",
    "What is the `{module}` module for? Give its documentation.",
    "Explain the `{module}` module of the Python standard library.",
)


def _is_pydoc_material(module: str) -> bool:
    return module in PYDOC_MODULES or module.split(".")[0] in PYDOC_MODULES


def _start(node: ast.stmt) -> int:
    """The 0-based first line of a statement, its decorators included."""
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))]) - 1


def _pieces(module: str, source: str, tree: ast.Module) -> list[tuple[str, str]]:
    """(name of the first definition, text) pieces of a module's source: consecutive runs of its lines, cut before
    top-level statements (and before the methods of a class longer than `_PIECE_CHARS`), each at most `_PIECE_CHARS`
    long (a longer statement is cut at a line end)."""
    lines = source.splitlines(keepends=True)
    starts: list[tuple[int, str]] = []  # (first line, name) of each unit
    for node in tree.body:
        first = _start(node)
        starts.append((first, getattr(node, "name", module.rsplit(".", 1)[-1])))
        if isinstance(node, ast.ClassDef) and len("".join(lines[first : node.end_lineno])) > _PIECE_CHARS:
            methods = (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
            starts.extend((_start(n), n.name) for n in methods)
    if not starts:
        return []
    starts[0] = (0, starts[0][1])  # the comments before the first statement go with it
    bounds = [line for line, _ in starts] + [len(lines)]
    units = [("".join(lines[a:b]), name) for (a, name), b in zip(starts, bounds[1:]) if b > a]
    pieces: list[tuple[str, str]] = []
    text, name = "", ""
    for unit, unit_name in units:
        if text and len(text) + len(unit) > _PIECE_CHARS:
            pieces.append((name, text))
            text = ""
        if not text:
            name = unit_name
        text += unit
    if text:
        pieces.append((name, text))
    out = []
    for name, text in pieces:
        if len(text) > _PIECE_CHARS:  # one long statement: cut at the last line end that fits
            cut = text.rfind("\n", 0, _PIECE_CHARS)
            text = text[: cut + 1 if cut > 0 else _PIECE_CHARS]
        text = text.strip("\n")
        if len(text) >= _MIN_PIECE_CHARS:
            out.append((name, text))
    return out


def stdlib_text_records(num_records: int | None = None, seed: int = 0) -> list[dict[str, str]]:
    """``{"prompt", "response", "module"}`` records whose responses are the installed stdlib's source code (in fenced
    ``python`` blocks) and module docstrings, shuffled by `seed`; at most `num_records` (the first ones)."""
    rng = random.Random(f"moa-stdlib-text-{seed}")
    records: list[dict[str, str]] = []
    for module, path in stdlib_modules():
        if _is_pydoc_material(module):
            continue
        source = read_source(path)
        try:
            tree = ast.parse(source) if source is not None else None
        except (SyntaxError, ValueError):
            tree = None
        if tree is None:
            continue
        pieces = _pieces(module, source, tree)
        doc = ast.get_docstring(tree)
        if doc and len(doc) > _MIN_DOC_CHARS:
            prompt = rng.choice(_DOC_TEMPLATES).format(module=module)
            records.append({"prompt": prompt, "response": doc[:_MAX_DOC_CHARS], "module": module})
        for name, text in pieces:
            prompt = rng.choice(_SOURCE_TEMPLATES).format(name=name, module=module)
            records.append({"prompt": prompt, "response": f"```python\n{text}\n```", "module": module})
    rng.shuffle(records)
    return records if num_records is None else records[: int(num_records)]
