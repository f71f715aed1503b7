"""The package's shape (issue 29): no import cycle between its modules, imports at module
level, no module of a subpackage past ~600 lines, and no module outside ``backends/``
importing a concrete backend.

An import inside a function hides a cycle or an optional dependency; each one left
carries a comment saying why (issue 20). The graph is read from the source (AST), so a
cycle that happens to load in today's import order still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "django_tokenbucket"
MAX_FUNCTION_LEVEL_IMPORTS = 5


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {
        _module_name(path): (path, ast.parse(path.read_text(), str(path)))
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts
    }


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # "from . import x" and "from .pkg import module" may name modules.
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Imports run when the module is imported: its body, and its if/try blocks."""
    found: list[ast.stmt] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                continue
            pending.extend(node.body)
            pending.extend(node.orelse)
            if isinstance(node, ast.Try):
                for handler in node.handlers:
                    pending.extend(handler.body)
                pending.extend(node.finalbody)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, tree) in modules.items():
        for node in _top_level_imports(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(name, path.name == "__init__.py", node)
            else:
                targets = [alias.name for alias in node.names]
            graph[name].update(target for target in targets if target in modules and target != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_level_import_cycle():
    # A package imports its parent package's __init__ first: those edges are not cycles.
    graph = _graph()
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_inside_functions_are_few_and_each_says_why():
    inside = []
    for name, (path, tree) in _modules().items():
        lines = path.read_text().splitlines()
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    line = node.lineno - 1
                    above = lines[line - 1].strip()
                    comment = lines[line].partition("#")[2].strip() or (
                        above[1:].strip() if above.startswith("#") else ""
                    )
                    inside.append((f"{name}:{node.lineno}", comment))
    assert len(inside) <= MAX_FUNCTION_LEVEL_IMPORTS, inside
    assert [where for where, why in inside if not why] == []


#: Lines a module of one of the package's subpackages (backends, admin, integrations) may
#: hold: each says what it holds by its name, and none grows into a second admin.py.
MAX_SUBPACKAGE_MODULE_LINES = 600


def test_no_module_of_a_subpackage_grows_past_the_bound():
    too_long = {
        name: len(path.read_text().splitlines())
        for name, (path, _tree) in _modules().items()
        if name.count(".") >= 2 or (path.name == "__init__.py" and name.count(".") == 1)
    }
    assert {name: lines for name, lines in too_long.items() if lines > MAX_SUBPACKAGE_MODULE_LINES} == {}


#: The backends whose modules only ``backends/`` may import: everything else reaches a
#: store through ``BaseBackend`` (``backends.get_backend``, ``backends.row_backend``) and
#: ``operations``, so a new backend needs no change outside its own package.
CONCRETE_BACKENDS = ("django_tokenbucket.backends.database", "django_tokenbucket.backends.redis")


def _concrete_backend_imports(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    found = []
    for name, (path, tree) in modules.items():
        if name.startswith("django_tokenbucket.backends"):
            continue
        # Every import counts, also one inside a function or under TYPE_CHECKING.
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(name, path.name == "__init__.py", node)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            found += [
                f"{name}:{node.lineno} imports {target}"
                for target in targets
                if any(target == backend or target.startswith(backend + ".") for backend in CONCRETE_BACKENDS)
            ]
    return sorted(set(found))


def test_only_backends_import_a_concrete_backend():
    assert _concrete_backend_imports(_modules()) == []


def test_the_layering_check_finds_a_concrete_backend_import():
    def module(source: str) -> tuple[Path, ast.Module]:
        return PACKAGE / "admin" / "example.py", ast.parse(source)

    found = _concrete_backend_imports(
        {
            "django_tokenbucket.admin.a": module("from ..backends.database.filters import at_least_q"),
            "django_tokenbucket.admin.b": module("def f():\n    from ..backends import redis"),
            "django_tokenbucket.c": module("import django_tokenbucket.backends.redis.keyspace"),
            "django_tokenbucket.d": module("from .backends import get_backend, row_backend"),
            "django_tokenbucket.backends.e": module("from .database import DatabaseBackend"),
        }
    )
    assert found == [
        "django_tokenbucket.admin.a:1 imports django_tokenbucket.backends.database.filters",
        "django_tokenbucket.admin.a:1 imports django_tokenbucket.backends.database.filters.at_least_q",
        "django_tokenbucket.admin.b:2 imports django_tokenbucket.backends.redis",
        "django_tokenbucket.c:1 imports django_tokenbucket.backends.redis.keyspace",
    ]


def test_only_backends_query_rate_limit_rows():
    # The admin's changelist lists the rows Django's admin hands it; resets, set-tokens,
    # counts and cleanup go through the backend (issue 29, item 2).
    managers = {"objects", "_default_manager", "_base_manager"}
    found = [
        f"{name}:{node.lineno}"
        for name, (_path, tree) in _modules().items()
        if not name.startswith("django_tokenbucket.backends")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in managers
        and isinstance(node.value, ast.Name)
        and node.value.id == "RateLimit"
    ]
    assert found == []


#: Lines api.py may hold: the Limiter is a face over ``engine`` (issue 50). The override
#: admin methods (``OVERRIDE_ADMIN``) are not counted while they live there.
MAX_API_LINES = 450
OVERRIDE_ADMIN = {
    "override",
    "exempt",
    "block",
    "clear_override",
    "overrides",
    "aoverride",
    "aexempt",
    "ablock",
    "aclear_override",
    "aoverrides",
    "_override_name",
    "_save_override",
    "_override_numbers",
}


def test_api_is_a_thin_face():
    path, tree = _modules()["django_tokenbucket.api"]
    admin_lines = sum(
        node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in OVERRIDE_ADMIN
    )
    assert len(path.read_text().splitlines()) - admin_lines < MAX_API_LINES


def _imported_targets(name: str, path: Path, tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """Every import of a module (inside functions and under TYPE_CHECKING too): its line,
    the module it names and the names it takes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node)[0]
            found.append((node.lineno, target, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
    return found


def test_the_engine_never_imports_the_api():
    # Layering: api → engine → backends, algorithms and the process' state modules.
    upward = [
        f"{name}:{line} imports {target}"
        for name, (path, tree) in _modules().items()
        if name.startswith("django_tokenbucket.engine")
        for line, target, names in _imported_targets(name, path, tree)
        if target == "django_tokenbucket.api"
        or (target == "django_tokenbucket" and "api" in names)
        or target.startswith(("django_tokenbucket.throttling", "django_tokenbucket.decorators"))
    ]
    assert upward == []


def test_no_private_name_of_the_engine_or_the_api_is_used_elsewhere():
    """Callers use the engine's public entries (``limiter.engine.decide_many``), not
    what a module keeps to itself (issue 50: the throttle called ``limiter._decide_many``)."""
    owners = ("django_tokenbucket.api", "django_tokenbucket.engine")
    tests = {
        f"tests.{path.stem}": (path, ast.parse(path.read_text(), str(path)))
        for path in Path(__file__).resolve().parent.glob("*.py")
    }
    found = []
    for name, (path, tree) in {**_modules(), **tests}.items():
        for line, target, names in _imported_targets(name, path, tree):
            if target.startswith(owners) and not name.startswith(target):
                found += [f"{name}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
        if name.startswith(owners):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in ("limiter", "Limiter", "engine")
            ):
                found.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert found == []


#: Each feature of a decision, as the call that performs it: the decision pipeline
#: (``engine/decide.py``) is written once, so each is called from one place only.
FEATURES = {
    "overrides lookup": ("overrides", {"lookup", "current"}),
    "deny-cache recall": ("deny_cache", {"lookup"}),
    "deny-cache learn (a denial)": ("deny_cache", {"remember"}),
    "deny-cache learn (an admission)": ("deny_cache", {"admitted"}),
    "analytics count (allowed)": ("analytics", {"record_allowed"}),
    "analytics count (denied)": ("analytics", {"record_denied"}),
    "metrics report": (None, {"decision"}),
}


def _feature_calls(modules: dict[str, tuple[Path, ast.Module]]) -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {feature: [] for feature in FEATURES}
    for name, (_path, tree) in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            for feature, (module, attributes) in FEATURES.items():
                if node.func.attr not in attributes:
                    continue
                if module is None or (isinstance(owner, ast.Name) and owner.id == module):
                    calls[feature].append(f"{name}:{node.lineno}")
    return calls


def test_each_feature_of_a_decision_is_called_from_one_place_in_the_engine():
    calls = _feature_calls(_modules())
    # ``.decision(...)`` is the metrics recorder's; a backend's ``decide`` is another name.
    assert {feature: len(sites) for feature, sites in calls.items()} == dict.fromkeys(FEATURES, 1), calls
    outside = [site for sites in calls.values() for site in sites if not site.startswith("django_tokenbucket.engine")]
    assert outside == []


def test_the_feature_check_counts_every_call_site():
    source = (
        "deny_cache.lookup(a)\nif x:\n    deny_cache.lookup(b)\nrecorder.decision(n, l, o)\noverrides.current(n, d)"
    )
    calls = _feature_calls({"django_tokenbucket.engine.x": (PACKAGE / "engine" / "x.py", ast.parse(source))})
    assert calls["deny-cache recall"] == ["django_tokenbucket.engine.x:1", "django_tokenbucket.engine.x:3"]
    assert calls["metrics report"] == ["django_tokenbucket.engine.x:4"]
    assert calls["overrides lookup"] == ["django_tokenbucket.engine.x:5"]
