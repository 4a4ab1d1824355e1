"""The package's layering, read from the source: the core never imports the notebook layer or its
libraries, no import runs from a lower layer to a higher one, and module-level imports form no
circle. Static (``ast``), so it needs no TensorFlow and runs in well under a second."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tfnb"

# Lower layers first; a module may import its own layer and the ones below it. The notebook layer
# (IPython, ipywidgets) sits above the whole core; the package's face and commands above it.
LAYERS = [
    ("tfnb.errors", "tfnb.names", "tfnb.hooks", "tfnb.shutdown", "tfnb.kernels"),
    ("tfnb.cluster", "tfnb.models"),
    ("tfnb.runtime",),
    ("tfnb.placement", "tfnb.serving"),
    ("tfnb.profiler",),
    ("tfnb.notebook",),
    ("tfnb", "tfnb.demo", "tfnb.bench", "tfnb.cli"),
]
RANK = {part: i for i, parts in enumerate(LAYERS) for part in parts}
UI_LIBRARIES = ("IPython", "ipywidgets")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The layer entry a module belongs to: its first two name parts if listed, else the package."""
    two = ".".join(module.split(".")[:2])
    if two in RANK:
        return two
    assert module.split(".")[0] == "tfnb", module
    return "tfnb" if module.count(".") == 0 else pytest.fail(f"{module}: in no layer of LAYERS")


def imports(path: Path, module_level_only: bool = False):
    """Yield ``(imported module, line)`` for every import in a file, resolving relative ones and
    ``from tfnb import sub`` to the submodule."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    nodes = tree.body if module_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                is_sub = (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() or (
                    ROOT.parent / sub.replace(".", "/")).is_dir()
                yield (sub if is_sub else source), node.lineno


SOURCES = sorted(ROOT.rglob("*.py"))


def test_every_module_is_in_a_layer():
    for path in SOURCES:
        part_of(module_name(path))


def test_the_core_imports_no_notebook_library_and_no_import_runs_upward():
    wrong = []
    for path in SOURCES:
        me = module_name(path)
        mine = part_of(me)
        for target, line in imports(path):
            top = target.split(".")[0]
            where = f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
            if top in UI_LIBRARIES and RANK[mine] < RANK["tfnb.notebook"]:
                wrong.append(f"{where} (the core must not import {top})")
            elif top == "tfnb" and RANK[part_of(target)] > RANK[mine]:
                wrong.append(f"{where} (layer {part_of(target)} is above {mine})")
    assert not wrong, "\n".join(wrong)


def test_module_level_imports_form_no_circle():
    graph = {module_name(p): {t for t, _ in imports(p, module_level_only=True)
                              if t.startswith("tfnb")} for p in SOURCES}
    state: dict[str, int] = {}   # 1 = on the current path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or state.get(nxt) == 2:
                continue
            # A package's own __init__ importing its children is how it hands names on.
            if node == nxt or (nxt.startswith(node + ".") and node in graph):
                continue
            assert state.get(nxt) != 1, "import circle: " + " -> ".join(path + [nxt])
            visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_reader_resolves_submodules_imported_from_a_package():
    """``from tfnb import kernels`` is read as tfnb.kernels, not as the package's face (which sits
    on the top layer and would hide what a module really uses)."""
    path = ROOT / "runtime" / "forward.py"
    found = {t for t, _ in imports(path)}
    assert "tfnb.kernels" in found                        # `from tfnb import kernels`
    assert RANK[part_of("tfnb.notebook.magics")] > RANK[part_of("tfnb.runtime.forward")]
