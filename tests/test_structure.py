"""The package's structure: imports follow one order — faces -> engine -> speculative / drafter ->
model -> kernels — with no cycles, `pallas_kernels` imports nothing from `jdspark`, and modules and
functions stay short. Read from the source with `ast`, so a late (function-level) import counts as
much as a top-level one."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Rank of each top-level part: a module may import only parts of its own rank or lower.
RANKS = {
    "pallas_kernels": 0,
    "jdspark.config": 1, "jdspark.tokenizer": 1, "jdspark.assets": 1,
    "jdspark.model": 2, "jdspark.experts": 2, "jdspark.parallel": 2,
    "jdspark.checkpoint": 3, "jdspark.speculative": 3, "jdspark.drafter": 3,
    "jdspark.engine": 4,
    "jdspark.generator": 5, "jdspark.server": 5, "jdspark.cli": 5, "jdspark.profile": 5, "jdspark.train": 5,
    "jdspark": 6,  # the public API re-exports the faces
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, pathlib.Path]:
    files = [*(ROOT / "jdspark").rglob("*.py"), *(ROOT / "pallas_kernels").rglob("*.py")]
    return {module_name(p): p for p in files}


def imports_of(path: pathlib.Path, modules: dict) -> set[str]:
    """The project modules `path` imports (`from pkg import sub` names the submodule, not pkg)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules:
                found.add(name)
    return found


def part(module: str) -> str:
    if module.startswith("pallas_kernels"):
        return "pallas_kernels"
    pieces = module.split(".")
    return ".".join(pieces[:2])


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports_of(p, modules) - {m} for m, p in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_every_module_has_a_rank():
    assert not [m for m in package_modules() if part(m) not in RANKS]


def test_no_import_cycle():
    assert find_cycle(graph()) is None


def test_imports_follow_the_layer_order():
    against = [(m, d) for m, deps in graph().items() for d in deps if RANKS[part(d)] > RANKS[part(m)]]
    assert not against, "imports against faces -> engine -> speculative/drafter -> model -> kernels: " + str(against)


def test_kernels_import_nothing_from_jdspark():
    assert not [(m, d) for m, deps in graph().items() if part(m) == "pallas_kernels" for d in deps
                if d.startswith("jdspark")]


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a cycle and an import against the order are found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert RANKS[part("jdspark.generator")] > RANKS[part("jdspark.engine.engine")]  # engine -> generator is upward


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def test_modules_and_functions_stay_short():
    """No module in jdspark/ over 400 lines and no function over 60: past that, split by concern."""
    long_modules, long_functions = [], []
    for module, path in package_modules().items():
        if not module.startswith("jdspark"):
            continue
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append(module)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long_functions.append(f"{module}.{node.name}")
    assert not long_modules and not long_functions, (long_modules, long_functions)
