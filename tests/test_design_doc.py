"""docs/design.md's "Where a change goes" stays true to the code: every file it names exists, and every file the code
ties to one of the six everyday changes is named in that change's row (read with `ast`, nothing imported). README
stays short."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("modeling", "moa_hf", "training", "hub_cards")
ROWS = {  # the row's first cell -> what ties a library file to that change (names it uses in code, not in prose)
    "a target family's quirk": {
        "layer_types", "layer_type", "sliding_window", "use_sliding_window", "max_window_layers",
        "attention_chunk_size", "is_sliding", "target_layer_windows", "target_layer_types",
    },
    "the acceptance rule": {"accept", "speculative"},  # imports of the rule's module or its re-export
    "a new drafter architecture": {"EagleDrafterModel", "EagleDrafterConfig"},  # a kind's classes (EAGLE's)
    "a CLI flag": {"add_argument", "HfArgumentParser"},
    "a server protocol field": {"CreateSessionRequest", "VerifyRequest", "VerifyResult"},
    # the drafter's one input of the target's state, its readers and the stores they read at inference
    "a new signal of the target's state": {
        "TargetStates", "CacheReader", "SlotReader", "HiddenRecordingCache", "StepTap", "hidden_at",
    },
}  # fmt: skip
IMPORT_ROWS = {"the acceptance rule"}  # matched on the imported modules' last part only


def where_a_change_goes(text: str) -> dict[str, str]:
    """{change: its files cell} of the table under "### Where a change goes"."""
    section = text.split("### Where a change goes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| (.+) \|$", section, flags=re.MULTILINE)
    return {change: files for change, files in rows if change not in ("change", "---")}


def named_paths(cell: str) -> list[str]:
    """The repo paths a cell names in backticks (`modeling/x.py`, `tests/factory.py`, `modeling/modeling_*.py`)."""
    return [p for p in re.findall(r"`([\w./*-]+)`", cell) if "/" in p or p == "Makefile"]


def code_names(source: str, imports_only: bool = False) -> set[str]:
    """What `source` uses in code: names, attributes, keywords, getattr strings and imported modules (with
    `imports_only`, the last part of the modules it imports from); never its docstrings or comments."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.rpartition(".")[2])
        elif isinstance(node, ast.ImportFrom):  # `from . import accept`
            found.update(alias.name for alias in node.names)
        elif imports_only:
            continue
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                found.add(node.args[1].value)
    return found


def _listed(path: str, patterns: list[str]) -> bool:
    return any(Path(path).match(p) and path.count("/") == p.count("/") for p in patterns)


TABLE = where_a_change_goes((ROOT / "docs/design.md").read_text(encoding="utf-8"))


def test_the_table_has_the_six_changes_and_names_real_files():
    assert list(TABLE) == list(ROWS)
    missing = [p for cell in TABLE.values() for p in named_paths(cell) if not list(ROOT.glob(p))]
    assert not missing, f"docs/design.md names files that do not exist: {missing}"


@pytest.mark.parametrize("change", list(ROWS))
def test_every_file_tied_to_a_change_is_listed(change):
    listed = named_paths(TABLE[change])
    tied = [
        str(path.relative_to(ROOT))
        for folder in LIBRARY
        for path in sorted((ROOT / folder).rglob("*.py"))
        if code_names(path.read_text(encoding="utf-8"), imports_only=change in IMPORT_ROWS) & ROWS[change]
    ]
    assert tied, f"nothing in the code ties to {change!r}: update ROWS in this test"
    unlisted = [path for path in tied if not _listed(path, listed)]
    assert not unlisted, f"docs/design.md, 'Where a change goes', {change!r}: add {unlisted} to its files"


def test_the_checks_find_what_they_forbid():
    source = 'import x\nfrom .accept import verify\n"""layer_types"""\ngetattr(c, "sliding_window")\nf(is_sliding=1)\n'
    assert {"accept", "sliding_window", "is_sliding"} <= code_names(source) and "layer_types" not in code_names(source)
    assert code_names(source, imports_only=True) == {"accept"}
    assert _listed("modeling/modeling_eagle.py", ["modeling/modeling_*.py"])
    assert not _listed("modeling/custom_generate/policy.py", ["modeling/*.py"])
    assert named_paths("`modeling/x.py` (`f`), `tests/factory.py`, `Makefile`") == [
        "modeling/x.py", "tests/factory.py", "Makefile"
    ]  # fmt: skip


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 200, f"README.md has {lines} lines (> 200): move details to docs/"
