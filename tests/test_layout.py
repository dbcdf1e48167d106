"""The package's shape (DESIGN §2, §6): small files and classes, layers that import downward only, no cycles.

A capability that lands inside an existing file until it passes these limits is a room that should be
two; an import from a higher layer is a seam that is missing.
"""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvserve"
MAX_FILE_LINES = 400  # DESIGN §6: past ~400 lines, Python or C++, a file is doing two jobs
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
MAX_CLASS_LINES = 250

# Lowest first: a unit may import its own layer or lower ones, never a higher one.
LAYERS = [
    {"errors", "arith", "config_fields", "cpu_features", "memory_sizes", "huge_pages"},
    {"config"},
    {"kernels"},
    {"platform"},
    {"kv"},
    {"kv.attention"},
    {"kv.compression"},  # KV compression (issue 43): scores, kept tokens, attention over them
    {"model"},
    {"structured"},  # grammar-constrained decoding (issue 29)
    {"tools"},  # tool definitions into prompts, tool calls out of outputs
    {"engine"},
    {"llm", "planner"},
    {"server"},
    {"replicas"},  # the server on Ray Serve (issue 31)
    {"engine_args", "serve_args", "generate_args", "memory_args", "doctor"},  # the commands' flags and runs
    {"cli"},
]
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: kvserve.kv.attention.cpu -> kv.attention, kvserve.kv.prefix.pins -> kv."""
    parts = module.split(".")[1:]
    if parts[:2] in (["kv", "attention"], ["kv", "compression"]):
        return ".".join(parts[:2])
    return parts[0] if parts else "kvserve"


def imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvserve"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("kvserve"))
    return found


def source_files() -> list[Path]:
    """Every Python and C++ source of the package (the kernels' .cpp files and headers included)."""
    return sorted(path for path in PACKAGE.rglob("*") if path.suffix in SOURCE_SUFFIXES)


def test_source_files_include_the_cpp_kernels():
    names = {path.name for path in source_files()}
    assert {"paged_decode.cpp", "kernels.h", "llm.py"} <= names


def test_no_file_over_400_lines_and_no_class_over_250():
    too_long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path in source_files()
                if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(PACKAGE.parent)}: class {node.name}, "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


def test_every_import_goes_downward():
    upward = []
    for module, path in modules().items():
        unit = unit_of(module)
        if unit == "kvserve":
            continue  # the package root re-exports the public API
        assert unit in LAYER_OF, f"{module}: place its unit {unit!r} in LAYERS"
        for imported in imports(path, top_level_only=False):
            target = unit_of(imported)
            if target != "kvserve" and LAYER_OF[target] > LAYER_OF[unit]:
                upward.append(f"{module} imports {imported}")
    assert not upward, upward


def test_no_import_cycles_between_modules():
    known = modules()
    graph = defaultdict(set)
    for module, path in known.items():
        for imported in imports(path, top_level_only=True):
            # `from kvserve.kv import manager` names a module too.
            graph[module].add(imported if imported in known else imported.rsplit(".", 1)[0])
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if target == module or target not in known or target == "kvserve":
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = 2

    for module in sorted(known):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles
