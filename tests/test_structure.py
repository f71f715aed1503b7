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
                    comment = lines[line].partition("#")[2].strip() or (above[1:].strip() if above.startswith("#") else "")
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


def _private_name_uses(modules: dict[str, tuple[Path, ast.Module]]) -> set[str]:
    """``from .x import _y``, and ``x._y`` on a module of the package bound by an import,
    wherever they are (a function, ``TYPE_CHECKING``): what one module takes of another's
    insides. A dunder is not private; a module named ``_x`` is a module, not a name."""
    found = set()
    for name, (path, tree) in modules.items():
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(name, path.name == "__init__.py", node)[0]
                if not target.startswith("django_tokenbucket"):
                    continue
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{target}.{alias.name}"
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.add(f"{name} imports {target}.{alias.name}")
            elif isinstance(node, ast.Import):
                bound.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in modules})
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.add(f"{name} uses {bound[node.value.id]}.{node.attr}")
    return found


#: The private names one module still takes from another (issue 50, item 2): each is
#: made public where it is defined, or stops being used, and leaves this list. Nothing
#: may join it. Within the Redis backend, its modules share their script's and
#: connections' helpers; the Celery task, the django-ratelimit layer and the DRF views
#: theirs with their package; ``testing`` pins the clock.
PRIVATE_NAMES_STILL_SHARED = {
    "django_tokenbucket.backends.redis.aio imports django_tokenbucket.backends.redis.clients._imported",
    "django_tokenbucket.backends.redis.analytics imports django_tokenbucket.backends.redis.connections._may_have_run",
    "django_tokenbucket.backends.redis.analytics imports django_tokenbucket.backends.redis.script._text",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.connections._may_have_run",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.connections._single_server_pool",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.keyspace._check_slots",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.keyspace._key_head",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.keyspace._node_clients",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.keyspace._state_key",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._HEADERS",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._INDEX_AND_COUNT",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._PINNED_HEADERS",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._capped",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._microseconds",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._msgpack",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._refund_request",
    "django_tokenbucket.backends.redis.backend imports django_tokenbucket.backends.redis.script._reply_outcome",
    "django_tokenbucket.backends.redis.bounded imports django_tokenbucket.backends.redis.connections._pooled_connection",
    "django_tokenbucket.backends.redis.keyspace imports django_tokenbucket.backends.redis.script._parse_state",
    "django_tokenbucket.backends.redis.keyspace imports django_tokenbucket.backends.redis.script._text",
    "django_tokenbucket.backends.redis.reads imports django_tokenbucket.backends.redis.script._decision",
    "django_tokenbucket.backends.redis.reads imports django_tokenbucket.backends.redis.script._make_outcome",
    "django_tokenbucket.backends.redis.reads imports django_tokenbucket.backends.redis.script._microseconds",
    "django_tokenbucket.backends.redis.reads imports django_tokenbucket.backends.redis.script._parse_state",
    "django_tokenbucket.celery.task imports django_tokenbucket.celery._current",
    "django_tokenbucket.celery.task imports django_tokenbucket.celery._publish",
    "django_tokenbucket.celery.task imports django_tokenbucket.celery._record_reservation",
    "django_tokenbucket.celery.task imports django_tokenbucket.celery._undo_reservation",
    "django_tokenbucket.compat.ratelimit.decorators imports django_tokenbucket.compat.ratelimit.core._group_of",
    "django_tokenbucket.compat.ratelimit.decorators imports django_tokenbucket.compat.ratelimit.core._last_status",
    "django_tokenbucket.testing uses django_tokenbucket.clock._override",
    "django_tokenbucket.throttling.views imports django_tokenbucket.throttling._no_store",
}


def test_no_module_takes_a_private_name_of_another():
    found = _private_name_uses(_modules())
    assert sorted(found - PRIVATE_NAMES_STILL_SHARED) == [], "make the name public where it is defined"
    assert sorted(PRIVATE_NAMES_STILL_SHARED - found) == [], "no longer used: remove it from the list"


def test_the_private_name_check_finds_one():
    def module(source: str, path: str = "a.py") -> tuple[Path, ast.Module]:
        return PACKAGE / "overrides" / path, ast.parse(source)

    found = _private_name_uses(
        {
            "django_tokenbucket.overrides": module("from .rows import _bump\nfrom . import rows", "__init__.py"),
            "django_tokenbucket.overrides.rows": module("_bump = 1\n__all__ = []"),
            "django_tokenbucket.overrides.store": module("from . import rows\nrows._bump(rows.__all__)"),
            "django_tokenbucket.overrides.snapshot": module("from .rows import __all__\nfrom django.db import _x"),
        }
    )
    assert found == {
        "django_tokenbucket.overrides imports django_tokenbucket.overrides.rows._bump",
        "django_tokenbucket.overrides.store uses django_tokenbucket.overrides.rows._bump",
    }
