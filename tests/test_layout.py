"""The dependency rule, read from the source with `ast` (nothing is imported): training -> moa_hf -> modeling.

- modeling/ (shipped as Hub remote code) imports only torch, transformers, the standard library and its sibling
  files (relative imports);
- moa_hf/ (serving included) never imports moa_hf.training; training/ may import moa_hf.
"""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"moa_hf": "moa_hf", "modeling": "moa_hf.modeling", "training": "moa_hf.training"}
MODELING_MAY_IMPORT = {"torch", "transformers"}


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _package(path: Path) -> str:
    """The dotted package a source file belongs to, e.g. moa_hf/serving/server.py -> moa_hf.serving."""
    folder, *subfolders = path.relative_to(ROOT).parent.parts
    return ".".join([PACKAGES[folder], *subfolders])


def import_statements(source: str) -> list[tuple[int, str, int, str, list[str]]]:
    """(line, the import as written, level, module, names) of every import in `source`, including those inside
    functions; `import a.b` gives module "a.b" and no names, `from ..a import b` level 2, module "a", names ["b"]."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}", 0, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            written = f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
            found.append((node.lineno, written, node.level, node.module or "", names))
    return found


def absolute_modules(level: int, module: str, names: list[str], package: str) -> list[str]:
    """The modules an import may load, resolved against the file's `package`: `from a import b` may load a and a.b
    (b may be a submodule)."""
    if level:
        parts = package.split(".")
        module = ".".join(parts[: len(parts) - level + 1] + ([module] if module else []))
    return [module] + [f"{module}.{name}" for name in names]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def modeling_violations(source: str, siblings: set[str]) -> list[tuple[int, str]]:
    """Imports of a modeling/ file other than torch, transformers, the standard library and `from .sibling`."""
    bad = []
    for line, written, level, module, names in import_statements(source):
        if level == 0:
            allowed = module.split(".")[0] in MODELING_MAY_IMPORT | set(sys.stdlib_module_names)
        else:  # `from .x import y` or `from . import x`: x must be a file of modeling/
            allowed = level == 1 and all(m in siblings for m in ([module.split(".")[0]] if module else names))
        if not allowed:
            bad.append((line, written))
    return bad


def training_imports(source: str, package: str) -> list[tuple[int, str]]:
    """Imports of moa_hf.training (or a top-level `training`) in a file of `package`."""
    bad = []
    for line, written, level, module, names in import_statements(source):
        loads = absolute_modules(level, module, names, package)
        if any(
            m == "moa_hf.training" or m.startswith("moa_hf.training.") or m.split(".")[0] == "training" for m in loads
        ):
            bad.append((line, written))
    return bad


@pytest.mark.parametrize("path", _files("modeling"), ids=_rel)
def test_modeling_imports_only_torch_transformers_stdlib_and_siblings(path):
    siblings = {p.stem for p in _files("modeling")}
    bad = [f"{_rel(path)}:{line}: `{written}`" for line, written in modeling_violations(path.read_text(), siblings)]
    assert not bad, (
        "modeling/ ships as Hub remote code: it may import only torch, transformers, the standard library and its "
        "sibling files (relative `from .x import y`). Move what these need into modeling/, or the code out of it:\n"
        + "\n".join(bad)
    )


@pytest.mark.parametrize("path", _files("moa_hf"), ids=_rel)
def test_moa_hf_and_serving_never_import_training(path):
    bad = [f"{_rel(path)}:{line}: `{written}`" for line, written in training_imports(path.read_text(), _package(path))]
    assert not bad, (
        "Dependencies point one way (training -> moa_hf -> modeling): moa_hf/ and moa_hf/serving/ must not import "
        "moa_hf.training. Move the needed code into moa_hf/ (or its caller into training/):\n" + "\n".join(bad)
    )


def test_the_checks_find_what_they_forbid():
    """The rules above fail on what they forbid (so that a passing run means something)."""
    source = (
        "import numpy\nimport torch.nn\nfrom typing import Any\nfrom ..training import trainer\n"
        "from .. import training\nfrom .lookup import x\nfrom . import drafting, numpy\nfrom moa_hf import y\n"
        "def f():\n    import training.cli\n"
    )
    siblings = {"lookup", "drafting"}
    assert [line for line, _ in modeling_violations(source, siblings)] == [1, 4, 5, 7, 8, 10]
    assert [line for line, _ in training_imports(source, "moa_hf.serving")] == [4, 5, 10]
    assert training_imports("from .training import x\n", "moa_hf") == [(1, "from .training import x")]
    assert training_imports("from .training import x\n", "moa_hf.serving") == []  # moa_hf.serving.training
    assert len(_files("modeling")) >= 3 and len(_files("moa_hf/serving")) >= 3


def test_packages_are_the_installed_ones():
    tomllib = pytest.importorskip("tomllib")
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {folder: package for package, folder in package_dir.items() if folder in PACKAGES} == PACKAGES


def vllm_imports(source: str) -> list[tuple[int, str]]:
    """Imports of vllm (the optional engine) in `source`."""
    return [
        (line, written)
        for line, written, level, module, _ in import_statements(source)
        if level == 0 and (module.split(".")[0] == "vllm")
    ]


@pytest.mark.parametrize(
    "path", [p for folder in PACKAGES for p in _files(folder) if "vllm" not in p.relative_to(ROOT).parts], ids=_rel
)
def test_only_moa_hf_vllm_imports_vllm(path):
    bad = [f"{_rel(path)}:{line}: `{written}`" for line, written in vllm_imports(path.read_text())]
    assert not bad, (
        "vLLM is an optional extra with its own venv: only moa_hf/vllm/ may import it (modeling/ and the rest of "
        "moa_hf/ must run without it):\n" + "\n".join(bad)
    )


def test_the_vllm_rule_finds_what_it_forbids():
    source = "import vllm\nfrom vllm.config import VllmConfig\nfrom .vllm import x\nimport vllmx\n"
    assert [line for line, _ in vllm_imports(source)] == [1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# One home per job: no private names across files, hub -> card one way, no oversized library file
# ---------------------------------------------------------------------------------------------------------------------
LIBRARY = (*PACKAGES, "hub_cards")
PROJECT_TOP_LEVEL = {"moa_hf", "modeling", "training", "hub_cards"}
MAX_LINES = 900
# files allowed past MAX_LINES, with why
LONG_FILES = {
    "moa_hf/offline_prompts.py": "prompt data, not code",
}


def _library_files() -> list[Path]:
    return [p for folder in LIBRARY for p in _files(folder)]


def private_imports(source: str) -> list[tuple[int, str]]:
    """Imports of a private name (`_x`) from another file of the project: `from .x import _y`, `from moa_hf.x import
    _y` (aliasing a public name to a private one, `import y as _y`, is fine)."""
    bad = []
    for line, written, level, module, names in import_statements(source):
        if (level or module.split(".")[0] in PROJECT_TOP_LEVEL) and any(n.startswith("_") for n in names):
            bad.append((line, written))
    return bad


@pytest.mark.parametrize("path", _library_files(), ids=_rel)
def test_no_private_name_is_imported_across_files(path):
    bad = [f"{_rel(path)}:{line}: `{written}`" for line, written in private_imports(path.read_text())]
    assert not bad, (
        "What sibling files share is public to them: import no `_private` name from another file. Give it a public "
        "name in its home file (and `__all__`), or move it to the file that uses it:\n" + "\n".join(bad)
    )


def _imports_hub(source: str, package: str) -> list[tuple[int, str]]:
    return [
        (line, written)
        for line, written, level, module, names in import_statements(source)
        if any(
            m == "moa_hf.hub" or m.startswith("moa_hf.hub.") for m in absolute_modules(level, module, names, package)
        )
    ]


@pytest.mark.parametrize("path", _files("hub_cards"), ids=_rel)
def test_the_card_builder_never_imports_hub(path):
    bad = [f"{_rel(path)}:{line}: `{written}`" for line, written in _imports_hub(path.read_text(), "moa_hf.hub_cards")]
    assert not bad, (
        "hub.py depends on the card builder (hub_cards/), never the reverse: pass what the card needs as arguments "
        "instead of importing moa_hf.hub:\n" + "\n".join(bad)
    )


def function_level_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of the imports inside functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom):
                    found.append((inner.lineno, "." * inner.level + (inner.module or "")))
                elif isinstance(inner, ast.Import):
                    found += [(inner.lineno, a.name) for a in inner.names]
    return found


def test_hub_imports_the_card_builder_at_the_top():
    bad = [
        f"moa_hf/hub.py:{line}: `{module}`"
        for line, module in function_level_imports((ROOT / "moa_hf/hub.py").read_text())
        if "hub_cards" in module
    ]
    assert not bad, "hub.py imports the card builder once, at the top (one-way dependency):\n" + "\n".join(bad)


@pytest.mark.parametrize("path", _library_files(), ids=_rel)
def test_no_library_file_is_over_the_size_limit(path):
    lines = len(path.read_text().splitlines())
    if _rel(path) in LONG_FILES:
        return
    assert lines <= MAX_LINES, (
        f"{_rel(path)} has {lines} lines (> {MAX_LINES}): one home per job. Split it by job into files (or a "
        "package) of their own, as moa_hf/bench/ and modeling/ (sorted_exits.py, target_parts.py, ...) are."
    )


MAX_CLASS_LINES = 500


def class_sizes(source: str) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every class in `source`, nested ones included."""
    return [
        (node.lineno, node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
    ]


@pytest.mark.parametrize("path", _library_files(), ids=_rel)
def test_no_class_is_over_the_size_limit(path):
    sizes = class_sizes(path.read_text())
    big = [f"{_rel(path)}:{line}: {name} ({n} lines)" for line, name, n in sizes if n > MAX_CLASS_LINES]
    assert not big, (
        f"A class over {MAX_CLASS_LINES} lines does several jobs: give each its own object the class holds "
        "(composition, as the drafter holds its sorted exits and target parts), or move code to functions:\n"
        + "\n".join(big)
    )


# The drafter-type registry (moa_hf/drafter_types.py) is the one place outside a kind's own files (modeling/ and its
# training adapter) that names kinds of drafter; these files read it instead (`drafter_type(...)`, `bench_methods`,
# `remote_code_files`, `auto_map`, `card`). moa_hf/serving and moa_hf/vllm serve the kinds with `vllm_support` only.
KIND_FREE = (
    "moa_hf/bench",
    "moa_hf/hub.py",
    "hub_cards",
    "moa_hf/tune.py",
    "moa_hf/tune_settings.py",
    "moa_hf/loading.py",
)


def kind_names(source: str, kinds: set[str]) -> list[tuple[int, str]]:
    """(line, what) of every place `source` names one of `kinds`: a string `"moa"`, a keyword `moa=` or an
    attribute `args.moa` (a kind in a longer string, `"moa_tree"`, is a method's name, not the kind's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in kinds:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.keyword) and node.arg in kinds:
            found.append((node.value.lineno, f"{node.arg}="))
        elif isinstance(node, ast.Attribute) and node.attr in kinds:
            found.append((node.lineno, f".{node.attr}"))
    return sorted(found)


@pytest.mark.parametrize(
    "path", [p for name in KIND_FREE for p in ([ROOT / name] if name.endswith(".py") else _files(name))], ids=_rel
)
def test_only_the_registry_names_drafter_kinds(path):
    from moa_hf.drafter_types import drafter_kinds

    bad = [f"{_rel(path)}:{line}: {what}" for line, what in kind_names(path.read_text(), set(drafter_kinds()))]
    assert not bad, (
        "What varies per kind of drafter is the registry's (moa_hf/drafter_types.py: `bench_methods`, "
        "`bench_default`, `remote_code_files`, `auto_map`, ...): read it there instead of naming a kind:\n"
        + "\n".join(bad)
    )


def test_the_one_home_rules_find_what_they_forbid():
    source = (
        "from .configuration_moa import _SIGNATURE_KEYS, x\nfrom moa_hf.bench import _encode\n"
        "from vllm import _custom_ops\nfrom .default_target import load as _load\nimport moa_hf.hub\n"
        "def f():\n    from moa_hf.hub import publish\n    from ..hub_cards import render_card\n"
    )
    assert [line for line, _ in private_imports(source)] == [1, 2]
    assert [line for line, _ in _imports_hub(source, "moa_hf.hub_cards")] == [5, 7]
    assert _imports_hub("from .. import hub\n", "moa_hf.hub_cards") == [(1, "from .. import hub")]
    assert function_level_imports(source) == [(7, "moa_hf.hub"), (8, "..hub_cards")]
    assert all((ROOT / name).is_file() for name in LONG_FILES)
    big = "class A:\n" + "    x = 1\n" * 600 + "class B:\n    class C:\n        pass\n"
    assert [(name, n) for _, name, n in class_sizes(big)] == [("A", 601), ("B", 3), ("C", 2)]
    named = 'paths = {"moa": x}\nf(eagle=1)\nargs.independent\nm = "moa_tree"\n"""moa docs"""\n'
    assert kind_names(named, {"moa", "eagle", "independent"}) == [(1, "'moa'"), (2, "eagle="), (3, ".independent")]
    assert all((ROOT / name).exists() for name in KIND_FREE)


def test_every_package_folder_is_shipped():
    """A wheel holds the packages pyproject.toml lists: every folder of the library with an `__init__.py`."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"hub_cards": "moa_hf.hub_cards", **PACKAGES}
    found = {
        ".".join([folders[init.relative_to(ROOT).parts[0]], *init.relative_to(ROOT).parts[1:-1]])
        for folder in LIBRARY
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found <= listed, f"Add {sorted(found - listed)} to `packages` in pyproject.toml (a wheel would lack them)."
