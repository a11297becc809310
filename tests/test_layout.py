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
