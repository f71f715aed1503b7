"""The package's shape (issue 29): no import cycle between its modules, imports at module
level, no module of a subpackage past ~600 lines, no module outside ``backends/``
importing a concrete backend, per-process state let go in one place (``lifecycle``),
and no private name of redis-py, django-redis, prometheus_client or Celery read but
those walled off and listed (issue 50).

An import inside a function hides a cycle or an optional dependency; each one left
carries a comment saying why (issue 20). The graph is read from the source (AST), so a
cycle that happens to load in today's import order still fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Callable, Collection
from importlib import import_module
from pathlib import Path

from django_tokenbucket import lifecycle

PACKAGE = Path(__file__).resolve().parents[1] / "django_tokenbucket"
MAX_FUNCTION_LEVEL_IMPORTS = 4


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


def _imports_of(name: str, path: Path, tree: ast.Module, modules: Collection[str]) -> set[str]:
    """The package's modules that importing ``name`` runs, by every import it holds: at
    module level, inside a function and under ``TYPE_CHECKING`` alike, since a lazy
    import is a dependency all the same, only found later.

    Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so a module
    depends on each package face above what it imports, but not on the packages it sits
    in (they are being imported already), unless it takes a name other than a module
    from one of them: that is a dependency on the face's body and, as a face imports its
    package's modules, a cycle.
    """
    own = {".".join(name.split(".")[:depth]) for depth in range(1, name.count(".") + 1)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node)[0]
            submodules = {f"{target}.{alias.name}" for alias in node.names} & set(modules)
            faces_read = {target} if len(submodules) < len(node.names) else set()
            wanted = submodules | faces_read
        elif isinstance(node, ast.Import):
            wanted, faces_read = {alias.name for alias in node.names}, set()
        else:
            continue
        for target in wanted:
            parts = target.split(".")
            for depth in range(1, len(parts) + 1):
                ancestor = ".".join(parts[:depth])
                if ancestor in modules and (ancestor not in own or ancestor in faces_read):
                    found.add(ancestor)
    found.discard(name)
    return found


def _graph(modules: dict[str, tuple[Path, ast.Module]] | None = None) -> dict[str, set[str]]:
    """Each module of the package and the modules importing it runs (``_imports_of``)."""
    modules = _modules() if modules is None else modules
    return {name: _imports_of(name, path, tree, modules) for name, (path, tree) in modules.items()}


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


def test_no_import_cycle_counting_every_import():
    assert _cycles(_graph()) == []


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


#: Where per-process state is let go (issue 50, item 3): one receiver of setting_changed,
#: one fork hook, and the tables of what they reset.
LIFECYCLE = "django_tokenbucket.lifecycle"


def _modules_that(modules: dict[str, tuple[Path, ast.Module]], found: Callable[[ast.AST], bool]) -> set[str]:
    return {name for name, (_path, tree) in modules.items() if any(found(node) for node in ast.walk(tree))}


def test_only_the_lifecycle_registers_a_fork_hook():
    def registers(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "register_at_fork"

    assert _modules_that(_modules(), registers) == {LIFECYCLE}


def test_only_the_lifecycle_receives_setting_changed():
    # Whether by @receiver(setting_changed) or setting_changed.connect: the name itself.
    def names(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "setting_changed") or (
            isinstance(node, ast.ImportFrom) and any(alias.name == "setting_changed" for alias in node.names)
        )

    assert _modules_that(_modules(), names) == {LIFECYCLE}


def _defines(function: str) -> Callable[[ast.AST], bool]:
    def defines(node: ast.AST) -> bool:
        return isinstance(node, ast.Module) and any(
            isinstance(statement, ast.FunctionDef) and statement.name == function for statement in node.body
        )

    return defines


def _holds_a_module_lock(node: ast.AST) -> bool:
    """A lock made at import, in the module or a class body: one a fork can copy held."""
    if not isinstance(node, (ast.Module, ast.ClassDef)):
        return False
    return any(
        isinstance(statement, (ast.Assign, ast.AnnAssign))
        and isinstance(statement.value, ast.Call)
        and isinstance(statement.value.func, ast.Attribute)
        and statement.value.func.attr in ("Lock", "RLock")
        for statement in node.body
    )


def test_every_module_with_state_a_fork_leaves_behind_is_reset_by_the_lifecycle():
    modules = _modules()
    reset = {module for module, _function in lifecycle.AFTER_FORK}
    assert _modules_that(modules, _defines("after_fork_in_child")) - {LIFECYCLE} == reset
    assert _modules_that(modules, _holds_a_module_lock) - reset == set()


def test_every_module_with_state_built_from_settings_is_reset_by_the_lifecycle():
    reset = {module for module, _function, _settings in lifecycle.ON_SETTING_CHANGED}
    assert _modules_that(_modules(), _defines("settings_changed")) <= reset


def test_every_reset_the_lifecycle_names_exists():
    calls = [(module, function) for module, function, _settings in lifecycle.ON_SETTING_CHANGED]
    for module, function in [*calls, *lifecycle.AFTER_FORK, *lifecycle.ON_TABLES_EMPTIED]:
        found: object = import_module(module)
        for name in function.split("."):
            found = getattr(found, name)
        assert callable(found), (module, function)


def test_the_lifecycle_lock_check_finds_a_lock_made_at_import():
    found = _modules_that(
        {
            "a": (PACKAGE / "a.py", ast.parse("import threading\n_lock = threading.Lock()")),
            "b": (PACKAGE / "b.py", ast.parse("class Pool:\n    _lock = threading.RLock()")),
            "c": (PACKAGE / "c.py", ast.parse("def f():\n    lock = threading.Lock()")),
        },
        _holds_a_module_lock,
    )
    assert found == {"a", "b"}


# -- other libraries' private names (issue 50, item 5) -------------------------------------------

#: The libraries whose private names (``_x``) the package must not read: what a release of
#: theirs may rename or drop without notice.
GUARDED_LIBRARIES = ("redis", "django_redis", "prometheus_client", "celery")
#: What remains, each walled off in one module that says why. An entry whose use is gone
#: fails the test too: the list says what is read today, no more.
ALLOWED_PRIVATE_READS = {
    # The spare connections poll a connection's socket (one poll(2) where the pool's
    # can_read() check makes four system calls) and reconnect one whose socket is None:
    # ~15 µs of a ~75 µs decision (docs/benchmarks.md). The module's docstring names it;
    # tests/test_redis.py fails when redis-py renames it, and a connection without it
    # goes through the pool's own lending.
    ("django_tokenbucket.backends.redis.spares", "_sock"),
    # The asyncio clients are built from the cache's blocking options: a PARSER_CLASS is
    # mapped to its asyncio counterpart, and redis-py names its parser classes only
    # privately (redis._parsers._HiredisParser and the rest).
    ("django_tokenbucket.backends.redis.aio", "_parsers"),
    ("django_tokenbucket.backends.redis.aio", "_HiredisParser"),
    ("django_tokenbucket.backends.redis.aio", "_RESP2Parser"),
    ("django_tokenbucket.backends.redis.aio", "_RESP3Parser"),
    ("django_tokenbucket.backends.redis.aio", "_AsyncHiredisParser"),
    ("django_tokenbucket.backends.redis.aio", "_AsyncRESP2Parser"),
    ("django_tokenbucket.backends.redis.aio", "_AsyncRESP3Parser"),
    # ... and a blocking Retry in CONNECTION_POOL_KWARGS becomes the same asyncio policy:
    # redis-py's Retry gives its retries (get_retries()) but not its backoff or errors.
    ("django_tokenbucket.backends.redis.aio", "_backoff"),
    ("django_tokenbucket.backends.redis.aio", "_supported_errors"),
    # A deferred delivery runs as Celery's Task.__call__ runs a task, pushing it on the
    # stack celery.current_task reads; Celery has no public way to push it.
    ("django_tokenbucket.celery.task", "_state"),
    ("django_tokenbucket.celery.task", "_task_stack"),
}
#: Private names that the package reads from other libraries than the guarded ones, where
#: a guarded library has a name of the same spelling: DRF's Request._request (the Django
#: request inside it; Celery's tasks have a _request) and Django's Model._meta (its
#: documented Options API).
NOT_GUARDED = {"_request", "_meta"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _library_private_names() -> set[str]:
    """The private names the guarded libraries define: attributes, functions, classes,
    module-level names, modules and packages (read from their source, not imported)."""
    defined = re.compile(r"(?:self\.|def |class |^\s*)(_[A-Za-z]\w*)\s*[:=(]", re.MULTILINE)
    names: set[str] = set()
    for library in GUARDED_LIBRARIES:
        spec = importlib.util.find_spec(library)
        assert spec is not None and spec.submodule_search_locations, f"{library} is not installed"
        for root in spec.submodule_search_locations:
            for path in Path(root).rglob("*.py"):
                names.update(defined.findall(path.read_text(errors="replace")))
                names.update(part for part in path.relative_to(root).with_suffix("").parts if _is_private(part))
    return {name for name in names if _is_private(name)}


def _names_defined(trees: list[ast.Module]) -> set[str]:
    """Every name the package binds itself (its attributes, functions, classes, arguments,
    ``__slots__``): a read of one of those is taken for the package's own, whatever else
    defines it."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__slots__" for t in node.targets):
                names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return names


def _private_reads(modules: dict[str, ast.Module], library_names: set[str]) -> set[tuple[str, str]]:
    """(module, name) for each private name of a guarded library that a module imports or
    reads as an attribute, or asks ``getattr``/``hasattr`` for."""
    theirs = library_names - _names_defined(list(modules.values())) - NOT_GUARDED
    found: set[tuple[str, str]] = set()
    for module, tree in modules.items():
        for node in ast.walk(tree):
            named: list[str] = []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.split(".")[0] in GUARDED_LIBRARIES:
                    named = node.module.split(".") + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                named = [p for a in node.names if a.name.split(".")[0] in GUARDED_LIBRARIES for p in a.name.split(".")]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                named = [node.attr] if node.attr in theirs else []
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
                asked = node.args[1] if len(node.args) > 1 else None
                named = [asked.value] if isinstance(asked, ast.Constant) and asked.value in theirs else []
            found.update((module, name) for name in named if _is_private(name))
    return found


def test_no_module_reads_a_private_name_of_redis_prometheus_or_celery_but_those_walled_off():
    modules = {name: tree for name, (_path, tree) in _modules().items()}
    found = _private_reads(modules, _library_private_names())
    assert sorted(found - ALLOWED_PRIVATE_READS) == [], "a private name of another library, read here"
    assert sorted(ALLOWED_PRIVATE_READS - found) == [], "allowed, but no longer read: drop it from the list"


def test_the_private_name_check_finds_each_kind_of_read():
    source = """
import prometheus_client.metrics
from celery._state import _task_stack
from redis import _parsers
flag = prometheus_client.metrics._use_created
def poll(link, retry):
    return link._sock, getattr(retry, "_backoff", None), hasattr(link, "_parser")
"""
    modules = {"django_tokenbucket.example": ast.parse(source)}
    found = {name for _module, name in _private_reads(modules, _library_private_names())}
    assert found == {"_state", "_task_stack", "_parsers", "_use_created", "_sock", "_backoff", "_parser"}


#: Lines api.py may hold: the Limiter is a face over ``engine`` and ``overrides`` (issue 50).
MAX_API_LINES = 450


def test_api_is_a_thin_face():
    path, _tree = _modules()["django_tokenbucket.api"]
    assert len(path.read_text().splitlines()) < MAX_API_LINES


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
                bound.update(
                    {alias.asname: alias.name for alias in node.names if alias.asname and alias.name in modules}
                )
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


def test_no_module_takes_a_private_name_of_another():
    # Issue 50, item 2: a name another module needs is public where it is defined (a
    # docstring, type hints), or the helper lives with its one user.
    assert sorted(_private_name_uses(_modules())) == [], "make the name public where it is defined"


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


def _names_from_an_ancestor_face(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """``from .. import name`` (or the absolute spelling, in a function or under
    ``TYPE_CHECKING`` too) where ``..`` is a package the module belongs to and ``name`` is
    not one of its modules: a name its ``__init__`` re-exports. A package's ``__init__``
    runs before any of its modules, so such a module leans on the face that re-exports
    the name, not on the module that defines it: a cycle, as soon as the face re-exports
    anything of that module."""
    found = []
    for name, (path, tree) in modules.items():
        for line, target, names in _imported_targets(name, path, tree):
            if name.startswith(f"{target}.") and target in modules and modules[target][0].name == "__init__.py":
                found += [f"{name}:{line} imports {n} from {target}" for n in names if f"{target}.{n}" not in modules]
    return sorted(found)


def test_no_module_takes_a_name_from_the_face_of_a_package_it_belongs_to():
    assert _names_from_an_ancestor_face(_modules()) == [], "import the name from the module that defines it"


def test_the_ancestor_face_check_finds_one():
    def module(source: str, path: str) -> tuple[Path, ast.Module]:
        return PACKAGE / path, ast.parse(source)

    found = _names_from_an_ancestor_face(
        {
            "django_tokenbucket.backends": module("from .aliases import get_backend", "backends/__init__.py"),
            "django_tokenbucket.backends.aliases": module("get_backend = 1", "backends/aliases.py"),
            "django_tokenbucket.backends.redis": module("from .checks import x", "backends/redis/__init__.py"),
            "django_tokenbucket.backends.redis.checks": module(
                "from .. import aliases, get_backend\nfrom . import x\n"
                "def f():\n    from django_tokenbucket.backends import get_backend",
                "backends/redis/checks.py",
            ),
        }
    )
    assert found == [
        "django_tokenbucket.backends.redis.checks:1 imports get_backend from django_tokenbucket.backends",
        "django_tokenbucket.backends.redis.checks:2 imports x from django_tokenbucket.backends.redis",
        "django_tokenbucket.backends.redis.checks:4 imports get_backend from django_tokenbucket.backends",
    ]


#: Subpackages whose ``__init__`` still holds code of its own (issue 50, item 6: each is
#: to move into a named module, leaving the ``__init__`` a face). None left.
NOT_YET_FACES: set[str] = set()


def _code_of_its_own(tree: ast.Module) -> list[str]:
    """Functions and classes an ``__init__`` defines, and statements that are not imports,
    ``__all__``, a docstring or a constant (a name bound to a literal)."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Try) and all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in node.body):
            continue  # an optional dependency's import, with the error that names the extra
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            try:
                ast.literal_eval(node.value)
                continue
            except ValueError:
                pass
            if isinstance(node.value, ast.Call) and ast.unparse(node.value).startswith(("'.'.join", '".".join')):
                continue  # a version string made of a constant
        found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_every_subpackage_init_is_a_face():
    # A subpackage's __init__ re-exports the public names of its named modules: code in
    # it is found by no module name, and what it imports runs before any of its modules.
    not_faces = {
        name: found
        for name, (path, tree) in _modules().items()
        if path.name == "__init__.py" and name != "django_tokenbucket" and (found := _code_of_its_own(tree))
    }
    assert set(not_faces) == NOT_YET_FACES, not_faces


def test_the_face_check_finds_a_function_and_a_computed_value():
    tree = ast.parse('"""Doc."""\nfrom .a import b\n__all__ = ["b"]\nX = 3\ndef f():\n    pass\nY = b()\n')
    assert _code_of_its_own(tree) == ["line 5: def f():", "line 7: Y = b()"]


def test_models_import_nothing_inside_a_function():
    # The models know nothing of the integrations that use them (Celery's reservations
    # look the Reservation model up): an import inside a method would hide such a link.
    path, tree = _modules()["django_tokenbucket.models"]
    inside = [
        node.lineno
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    assert inside == [], f"{path}: imports at lines {inside}"


#: The package's layers, lowest first (issue 50, item 7): a module imports only modules of
#: its own layer or of a layer before it, counting every import (``_graph``), and inside a
#: layer there is no cycle either. ``docs/architecture.md`` shows this table
#: (``render_layers``; ``python tests/test_structure.py`` rewrites it there). A name ending
#: in ``.*`` stands for every module below that package, not the package's face itself.
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "base",
        "values and their arithmetic, the checks' catalogue, the signals, what a process lets go "
        "and when; nothing of ours configured, no table, no I/O",
        (
            "algorithms",
            "rates",
            "limits",
            "keys",
            "status",
            "exceptions",
            "signals",
            "clock",
            "text",
            "live",
            "shards",
            "plans",
            "waits",
            "hints",
            "catalogue",
            "lifecycle",
        ),
    ),
    (
        "settings",
        "TOKENBUCKET read once, the limits a process knows, its logging",
        ("settings", "registry", "logs"),
    ),
    ("tables", "the models: buckets, overrides, reservations, analytics counts", ("models",)),
    (
        "stores",
        "the backends, each behind BaseBackend, and the aliases that name them",
        ("backends", "backends.*"),
    ),
    (
        "request keys",
        "a request's key, as our decorator builds it and as the django-ratelimit layer does "
        "(its package's face holds two constants)",
        (
            "collation",
            "ip",
            "request_keys",
            "compat",
            "compat.ratelimit",
            "compat.ratelimit.methods",
            "compat.ratelimit.keys",
        ),
    ),
    (
        "features",
        "what a decision consults or reports beside its store",
        ("deny_cache", "overrides", "overrides.*", "metrics", "prometheus_tallies", "analytics"),
    ),
    ("engine", "the decision pipeline, written once, and the plans of state", ("engine", "engine.*")),
    ("face", "the Limiter and the package's names", ("api", "")),
    (
        "operations",
        "what the admin and the command do with buckets and overrides, on any backend",
        ("operations", "override_operations", "cleanup"),
    ),
    ("views", "the limits on a view, decided for a request, and the responses", ("view_limits", "http")),
    (
        "integrations",
        "Django's, DRF's, Celery's and django-ratelimit's entry points, login protection, the "
        "admin, the command, the checks, the app",
        (
            "decorators",
            "middleware",
            "throttling",
            "throttling.*",
            "compat.ratelimit.core",
            "compat.ratelimit.decorators",
            "compat.ratelimit.exceptions",
            "compat.ratelimit.middleware",
            "compat.ratelimit.stores",
            "compat.ratelimit.checks",
            "celery",
            "celery.*",
            "auth",
            "auth.*",
            "admin",
            "admin.*",
            "management",
            "management.*",
            "tasks",
            "checks",
            "apps",
            "testing",
        ),
    ),
]

#: What a decision consults or reports beside its store: the engine calls each (``FEATURES``),
#: and the face none.
FEATURE_MODULES = ("deny_cache", "metrics", "analytics", "logs", "signals", "overrides", "overrides.snapshot")


def _layer_of(
    modules: Collection[str], layers: list[tuple[str, str, tuple[str, ...]]] = LAYERS
) -> dict[str, list[str]]:
    """Every module and the layers whose entries name it."""
    found: dict[str, list[str]] = {name: [] for name in modules}
    for layer, _what, entries in layers:
        for entry in entries:
            prefix = "django_tokenbucket" + (f".{entry}" if entry else "")
            for name in modules:
                below = entry.endswith(".*") and name.startswith(prefix[:-1])
                if below or name == prefix:
                    found[name].append(layer)
    return found


def _upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, str, tuple[str, ...]]] = LAYERS) -> list[str]:
    order = {layer: position for position, (layer, _what, _entries) in enumerate(layers)}
    layer_of = {name: found[0] for name, found in _layer_of(graph, layers).items() if len(found) == 1}
    return sorted(
        f"{name} ({layer_of[name]}) imports {target} ({layer_of[target]})"
        for name, targets in graph.items()
        for target in targets
        if order[layer_of[target]] > order[layer_of[name]]
    )


def test_every_module_is_in_one_layer():
    modules = _modules()
    placed = _layer_of(modules)
    assert {name: layers for name, layers in placed.items() if len(layers) != 1} == {}
    for layer, _what, entries in LAYERS:
        for entry in entries:
            assert any(_layer_of(modules, [(layer, "", (entry,))]).values()), f"{entry} names no module"


def test_no_import_points_to_a_higher_layer():
    assert _upward_imports(_graph()) == []


def test_the_layer_check_finds_an_import_pointing_up():
    layers = [("low", "", ("a", "b.*")), ("high", "", ("b", "c"))]
    graph = {
        "django_tokenbucket.a": {"django_tokenbucket.c"},
        "django_tokenbucket.b": {"django_tokenbucket.b.x"},
        "django_tokenbucket.b.x": set(),
        "django_tokenbucket.c": {"django_tokenbucket.a"},
    }
    assert _layer_of(graph, layers)["django_tokenbucket.b.x"] == ["low"]
    assert _upward_imports(graph, layers) == ["django_tokenbucket.a (low) imports django_tokenbucket.c (high)"]


def test_the_graph_counts_lazy_imports_and_the_faces_above_what_is_imported():
    sources = {
        "django_tokenbucket.a": "def f():\n    from .p.m import x\n",
        "django_tokenbucket.p": "from .m import x\n",
        "django_tokenbucket.p.m": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n",
        "django_tokenbucket.p.n": "from . import m\nfrom django_tokenbucket.p import x\n",
    }
    modules = {
        name: (PACKAGE / ("p/__init__.py" if name.endswith(".p") else "x.py"), ast.parse(source))
        for name, source in sources.items()
    }
    graph = _graph(modules)
    assert graph["django_tokenbucket.a"] == {"django_tokenbucket.p", "django_tokenbucket.p.m"}
    assert graph["django_tokenbucket.p.m"] == {"django_tokenbucket.a"}
    # p.n sits in p: importing the module m does not make it depend on p's face, taking
    # the name x from the face does.
    assert graph["django_tokenbucket.p.n"] == {"django_tokenbucket.p", "django_tokenbucket.p.m"}


def test_the_face_imports_no_feature_module():
    """The Limiter reaches the decision's features through the engine alone; its override
    methods write through ``overrides.store`` and parse with ``overrides.rules``."""
    modules = _modules()
    path, tree = modules["django_tokenbucket.api"]
    features = {f"django_tokenbucket.{name}" for name in FEATURE_MODULES}
    direct = set()
    for _line, target, names in _imported_targets("django_tokenbucket.api", path, tree):
        submodules = {f"{target}.{name}" for name in names} & set(modules)
        direct |= submodules | ({target} if len(submodules) < len(names) or not names else set())
    assert sorted(direct & features) == []


def render_layers() -> str:
    """The layer list of docs/architecture.md, from ``LAYERS``."""
    lines = []
    for position, (layer, what, entries) in enumerate(LAYERS, 1):
        names = ", ".join(f"`{entry or 'django_tokenbucket'}`" for entry in entries)
        lines.append(f"{position}. **{layer}**: {what}. {names}")
    return "\n".join(lines) + "\n"


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
LAYERS_BEGIN = "<!-- layers: from LAYERS in tests/test_structure.py; `python tests/test_structure.py` rewrites it -->\n"
LAYERS_END = "<!-- end of layers -->\n"


def _documented_layers() -> str:
    text = ARCHITECTURE.read_text()
    return text[text.index(LAYERS_BEGIN) + len(LAYERS_BEGIN) : text.index(LAYERS_END)]


def test_the_architecture_page_shows_the_layers_as_the_test_holds_them():
    assert _documented_layers() == render_layers(), "run `python tests/test_structure.py` to rewrite it"


def test_the_architecture_page_has_a_row_for_every_capability_of_a_backend():
    """Its table of ``BaseBackend``'s flags (what the admin and the command may ask of a
    store) lists each one: a flag added without a row left contributors guessing."""
    _path, tree = _modules()["django_tokenbucket.backends.base"]
    base = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "BaseBackend")
    flags = {
        node.target.id
        for node in base.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and ast.unparse(node.annotation) == "ClassVar[bool]"
        and node.target.id != "asyncio_native"  # how it runs, not an operation it offers
    }
    rows = set(re.findall(r"^\| `(\w+)` \|", ARCHITECTURE.read_text(), re.MULTILINE))
    assert len(flags) >= 6 and sorted(flags - rows) == []


def test_the_architecture_page_names_every_module():
    text = ARCHITECTURE.read_text()
    tree = text[text.index("## What lives where") : text.index("## Layers")]
    unnamed = [
        str(path.relative_to(PACKAGE))
        for path, _tree in _modules().values()
        if path.name != "__init__.py" and not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", tree)
    ]
    assert unnamed == [], "say in its 'What lives where' what each holds"


if __name__ == "__main__":
    text = ARCHITECTURE.read_text()
    begin, end = text.index(LAYERS_BEGIN) + len(LAYERS_BEGIN), text.index(LAYERS_END)
    ARCHITECTURE.write_text(text[:begin] + render_layers() + text[end:])
