"""How the files of modeling/ depend on each other, read from the source with `ast` (nothing is imported).

- no import circle among them (imports under `if TYPE_CHECKING:` count: they tie the files together all the same);
- no file calls, through `self`, a private method another file of modeling/ defines: the MoA drafter holds its parts
  (`MoASortedExits`, `MoATargets`, `MoATreeDrafting`) as objects with public methods instead of mixins reaching into
  each other. The one base class left, `DrafterMixin` (drafting.py: the runtime both drafter types share), keeps its
  protected hooks (`_prepare_draft`, `_start_session`, `_require`, ...), which its subclasses call and override.
"""

import ast
from pathlib import Path

MODELING = Path(__file__).resolve().parents[1] / "modeling"
BASE_CLASS = ("drafting.py", "DrafterMixin")  # whose private methods its subclasses in other files may call


def _module_name(path: Path, root: Path) -> str:
    """modeling/custom_generate/engine.py -> "custom_generate.engine"; a package's __init__.py -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the modules of `root` it imports (relative imports, wherever they stand)} for every file of root."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = [] if name == "" else package
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:  # `from . import x` imports the module x where there is one
                sub = f"{target}.{alias.name}" if target else alias.name
                edges.add(sub if sub in files else target)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as the list of its modules (the first repeated at the end), or None."""
    done, path = set(), []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def private_cross_file_calls(root: Path) -> list[str]:
    """ "file: self._name() (defined in other.py)" for every call through `self` of a private method that another file
    of `root` (its top level) defines and the calling file does not (methods of `BASE_CLASS` excepted)."""
    trees = {p.name: ast.parse(p.read_text()) for p in sorted(root.glob("*.py"))}
    defined: dict[str, set[str]] = {}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                defined.setdefault(node.name, set()).add(name)
    base_file, base_class = BASE_CLASS
    base = {
        f.name
        for c in ast.walk(trees[base_file])
        if isinstance(c, ast.ClassDef) and c.name == base_class
        for f in c.body
        if isinstance(f, ast.FunctionDef)
    }
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
                continue
            method = func.attr
            if not method.startswith("_") or method.startswith("__") or method in base:
                continue
            elsewhere = defined.get(method, set()) - {name}
            if elsewhere and name not in defined.get(method, set()):
                found.append(f"{name}:{node.lineno}: self.{method}() (defined in {', '.join(sorted(elsewhere))})")
    return found


def test_modeling_has_no_import_circle():
    graph = import_graph(MODELING)
    assert {"modeling_moa", "sorted_exits", "target_parts", "moa_state", "moa_routes", "drafting"} <= set(graph)
    assert "sorted_exits" in graph["moa_state"] and "target_parts" in graph["modeling_moa"]  # the edges are read
    cycle = import_cycle(graph)
    assert cycle is None, f"modeling/ has an import circle: {' -> '.join(cycle)}"


def test_modeling_files_call_no_private_method_of_a_sibling_file():
    found = private_cross_file_calls(MODELING)
    assert not found, (
        "private methods called across files of modeling/ (make them public, or keep them in one file):\n"
        + ("\n".join(found))
    )
