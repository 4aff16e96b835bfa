"""The package's structure, read with `ast`: no import circle, no import from a lower layer into a
higher one, no type erased to `object`, and every Triton kernel in `oasiskv/kernels/`.

The layers, lowest first; a package imports only from its own layer or lower ones:

- kernels: GPU kernels beside their torch references (and the torch form CPU runs).
- layers: a decoder layer's pieces: attention over the paged cache, rotary tables, fused norms.
- models, sparse: model families and their weights; the sparse machinery (working set, pipeline).
- config, sampling_params: what a user sets; `EngineConfig` nests sparse's `SparseConfig`.
- engine, distributed: the engine loop; distributed is its executor over several ranks (each
  rank runs the engine's model runner, and the engine starts the ranks).
- disagg: prefill and decode instances, engines built on `LLMEngine`.
- entrypoints, bench, eval and the package root (`oasiskv/__init__.py` exports `LLM`).

What counts: every import that runs, at module level or inside a function (an import delayed
into a function to dodge a circle still closes it). An import under `if TYPE_CHECKING:` runs
nothing: it names a type for annotations and is exempt from both checks.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "oasiskv"
LAYERS = (
    {"kernels"},
    {"layers"},
    {"models", "sparse"},
    {"config", "sampling_params"},
    {"engine", "distributed"},
    {"disagg"},
    {"entrypoints", "bench", "eval", ""},  # "": the package root
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. oasiskv.engine.llm_engine
    target: str  # the imported oasiskv module
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str:
    """The oasiskv module an imported name lives in: the name itself, or the module holding it."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imported_names(node: ast.Import | ast.ImportFrom, source: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        is_package = MODULES[source].name == "__init__.py"
        parts = source.split(".")[:len(source.split(".")) - node.level + is_package]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]


def is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def imports_of(source: str) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in imported_names(node, source):
                if name == "oasiskv" or name.startswith("oasiskv."):
                    found.append(Import(source, resolve(name), node.lineno))
            return
        children = node.orelse if isinstance(node, ast.If) and is_type_checking(node.test) else \
            ast.iter_child_nodes(node)
        for child in children:
            visit(child)

    visit(ast.parse(MODULES[source].read_text()))
    return found


ALL_IMPORTS = [i for m in sorted(MODULES) for i in imports_of(m)]


def layer(module: str) -> int:
    package = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if package in names)


def where(i: Import) -> str:
    return f"{MODULES[i.source].relative_to(PACKAGE.parent)}:{i.line} imports {i.target}"


def test_every_package_has_a_layer():
    for m in MODULES:
        layer(m)  # StopIteration names a package the list above lacks


def test_no_import_circle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in ALL_IMPORTS:
        if i.target != i.source:
            graph[i.source].add(i.target)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def circle_from(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := circle_from(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = circle_from(m)
            assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_import_from_a_lower_layer_into_a_higher_one():
    upward = sorted({where(i) for i in ALL_IMPORTS if layer(i.target) > layer(i.source)})
    assert not upward, "imports into a higher layer:\n" + "\n".join(upward)


def erased(annotation: ast.expr | None) -> bool:
    """The annotation names `object` (also inside `X | None`, `list[...]` or a string)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(isinstance(n, ast.Name) and n.id == "object" or
               isinstance(n, ast.Constant) and isinstance(n.value, str) and erased(n)
               for n in ast.walk(annotation))


def test_no_type_is_erased_to_object():
    found = []
    for m, path in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign):
                annotations = [node.annotation]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                args = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
                annotations = [x.annotation for x in args] + [node.returns]
            else:
                continue
            if any(erased(x) for x in annotations):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "annotated `object` (a real type, a Protocol or a TYPE_CHECKING import instead):\n" + \
        "\n".join(found)


def test_every_triton_kernel_is_in_kernels():
    outside = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
               for m, path in sorted(MODULES.items()) if not m.startswith("oasiskv.kernels.")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and any(ast.unparse(d).startswith("triton.")
                                                            for d in node.decorator_list)]
    assert not outside, "Triton kernels outside oasiskv/kernels/:\n" + "\n".join(outside)
