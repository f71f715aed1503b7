"""Every snippet of README.md and docs/ runs as shown, in a project made by ``startproject``.

A newcomer copies snippets into a brand-new project; so does this test (tox -e docs).
For each page, a copy of a fresh ``django-admin startproject mysite`` gets:

- the page's settings blocks appended to ``mysite/settings.py``, after the README's
  quickstart settings that every other page builds on;
- blocks headed ``# myapp/<module>.py`` written to that file and imported (the README's
  Quick start view is also called, until it answers 429);
- every other Python block run in one namespace per page, in order (a view's body,
  with a bare ``return``, runs as a view's body), with the names the prose gives it:
  ``user``, ``uid``, ``ip``, ``tenant``, ``tenant_id``, ``request`` and the Django
  names a view module has imported (tests/docs_runner.py, ``given_names``);
- its ``python manage.py ...`` console lines run in the project.

Then ``migrate``, ``check`` (warnings fail too), and one ``check()`` of every configured
limit. A dict-entry fragment (``"OPTIONS": {"TIMEOUT": 2.0}``) is merged into the
page's ``TOKENBUCKET`` and checked the same way, each alternative on its own; so is a
settings block marked ``<!-- test: alternative -->`` (a different configuration, not a
step of the page's). ``redis://`` locations point at this machine's Redis.

An HTML comment right before a block (invisible on the rendered page) says when a
block is not run, and why: ``<!-- test: skip: <reason> -->``, ``<!-- test: syntax:
<reason> -->`` (parsed only), ``<!-- test: signature: <dotted.path> -->`` (must match
that object's real signature).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNER = Path(__file__).with_name("docs_runner.py")
ANNOTATION = re.compile(r"<!--\s*test:\s*(skip|alternative|syntax|signature)\s*(?::\s*(.*?))?\s*-->")
FILE_HEADER = re.compile(r"^# ((?:\w+/)*\w+\.py)\b.*$")
SHELL_LANGS = {"bash", "console"}
SUBPROCESS_TIMEOUT = 180


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    source: str
    annotation: str | None = None
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    """Return the page's Python and shell blocks, each with the annotation right before it."""
    lines = page.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[index])
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        lang = fence.group(1)
        if lang == "python" or lang in SHELL_LANGS:
            previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            marked = ANNOTATION.fullmatch(previous.strip())
            blocks.append(
                Block(
                    page,
                    index + 1,
                    lang,
                    "\n".join(lines[index + 1 : end]) + "\n",
                    marked.group(1) if marked else None,
                    (marked.group(2) or "") if marked else "",
                )
            )
        index = end + 1
    return blocks


def split_files(source: str) -> list[tuple[str | None, str]]:
    """Split a block at ``# path.py`` header lines into (path or None, text) parts."""
    parts: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in source.splitlines():
        header = FILE_HEADER.match(line)
        if header:
            parts.append((header.group(1), []))
        parts[-1][1].append(line)
    return [(path, "\n".join(text) + "\n") for path, text in parts if any(t.strip() for t in text)]


def _is_setting_target(target: ast.expr) -> bool:
    while isinstance(target, (ast.Subscript, ast.Attribute, ast.Call)):
        target = target.func if isinstance(target, ast.Call) else target.value
    return isinstance(target, ast.Name) and target.id.isupper()


def _is_settings_statement(node: ast.stmt) -> bool:
    """An assignment to a setting, a call on one (``DATABASES["default"].setdefault(...)``),
    or an ``if`` on settings holding only such statements."""
    if isinstance(node, ast.Assign):
        return all(_is_setting_target(t) for t in node.targets)
    if isinstance(node, ast.AugAssign):
        return _is_setting_target(node.target)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return _is_setting_target(node.value)
    if isinstance(node, ast.If):
        return all(_is_settings_statement(n) for n in [*node.body, *node.orelse])
    return False


def kind_of(path: str | None, text: str) -> str:
    """Say what a part is: "settings", "module" (a file of the project), "fragment" or "code"."""
    if path == "settings.py":
        return "settings"
    if path is not None:
        return "module"
    try:
        tree = ast.parse(text)
    except SyntaxError:
        fragment_alternatives(text)  # a dict-entry fragment, or a SyntaxError for the page
        return "fragment"
    statements = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))]
    if statements and all(_is_settings_statement(node) for node in statements):
        return "settings"
    return "code"


def fragment_alternatives(text: str) -> list[str]:
    """Split a fragment into alternatives: a key that repeats, or each line, starts one.

    ``"TRUSTED_PROXIES": 1`` and ``"TRUSTED_PROXIES": [...]`` on two lines without a comma
    are two ways to write one setting, not one dict.
    """
    try:
        entries = [ast.parse("{" + text + "\n}", mode="eval").body]
    except SyntaxError:
        lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        entries = [ast.parse("{" + line + "\n}", mode="eval").body for line in lines]
    alternatives = []
    for entry in entries:
        assert isinstance(entry, ast.Dict)
        group: list[str] = []
        for key, value in zip(entry.keys, entry.values, strict=True):
            assert key is not None, "a ** entry in a fragment"
            if any(item.startswith(ast.unparse(key) + ":") for item in group):
                alternatives.append(group)
                group = []
            group.append(f"{ast.unparse(key)}: {ast.unparse(value)}")
        alternatives.append(group)
    return ["{" + ", ".join(group) + "}" for group in alternatives]


def local_redis(text: str) -> str:
    return re.sub(
        r"redis://[\w.-]+:\d+(/\d+)?",
        f"redis://{settings.REDIS_HOST}:{settings.REDIS_PORT}/{settings.REDIS_DB}",
        text,
    )


# -- the throwaway project ---------------------------------------------------------------


@pytest.fixture(scope="session")
def fresh_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project as ``django-admin startproject mysite`` makes it, nothing else."""
    path = tmp_path_factory.mktemp("startproject")
    run([sys.executable, "-m", "django", "startproject", "mysite", str(path)], cwd=path)
    return path


def run(command: list[str], cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    return subprocess.run(
        command, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT
    )


class Project:
    def __init__(self, fresh: Path, path: Path) -> None:
        shutil.copytree(fresh, path)
        self.path = path
        self.steps: list[dict[str, str]] = []

    def add_settings(self, text: str, where: str) -> None:
        with (self.path / "mysite" / "settings.py").open("a") as file:
            file.write(f"\n# {where}\n{local_redis(text)}")

    def write_module(self, relative: str, text: str) -> None:
        target = self.path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        for package in target.relative_to(self.path).parents:
            if package != Path("."):
                (self.path / package / "__init__.py").touch()
        with target.open("a") as file:
            file.write(text)

    def add_module(self, relative: str, text: str, where: str) -> None:
        self.write_module(relative, text)
        self.import_module(relative, where)

    def import_module(self, relative: str, where: str) -> None:
        module = ".".join(Path(relative).with_suffix("").parts)
        self.steps.append({"kind": "import", "module": module, "where": where})

    def add_code(self, text: str, where: str) -> None:
        self.steps.append({"kind": "code", "source": text, "where": where})

    def run_steps(self) -> str:
        """Migrate, check, run the steps, ask every limit once; return the runner's output."""
        self.steps.append({"kind": "smoke", "where": "every configured limit answers"})
        (self.path / "steps.json").write_text(json.dumps(self.steps))
        shutil.copy(RUNNER, self.path / "docs_runner.py")
        done = run([sys.executable, "docs_runner.py", "steps.json"], cwd=self.path)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        return done.stdout

    def manage(self, arguments: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
        return run([sys.executable, "manage.py", *arguments], cwd=self.path, stdin=stdin)


def quickstart_settings() -> Block:
    """The README's first settings block: every docs page builds on it."""
    return next(b for b in read_blocks(ROOT / "README.md") if b.lang == "python" and "INSTALLED_APPS" in b.source)


def assigned_names(text: str) -> set[str]:
    """The names a settings part binds anew (``X = ...``, not ``X += ...`` or ``X[k] = ...``)."""
    return {
        target.id
        for node in ast.parse(text).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def settings_of(page: Path) -> tuple[list[tuple[Block, str]], list[tuple[Block, str]]]:
    """Split the page's settings parts into its steps and its alternatives.

    A part re-binding a setting an earlier step bound (a second ``TOKENBUCKET = {...}``
    showing another option) is another configuration, not the next step, and is tested
    on its own, like a block marked ``<!-- test: alternative -->``.
    """
    steps: list[tuple[Block, str]] = []
    alternatives: list[tuple[Block, str]] = []
    bound: set[str] = set()
    for block in read_blocks(page):
        if block.lang != "python" or block.annotation not in (None, "alternative"):
            continue
        for file_path, text in split_files(block.source):
            try:
                if kind_of(file_path, text) != "settings":
                    continue
            except SyntaxError:
                continue  # test_page_runs_as_shown reports it
            names = assigned_names(text)
            if block.annotation == "alternative" or names & bound:
                alternatives.append((block, text))
            else:
                steps.append((block, text))
                bound |= names
    return steps, alternatives


def page_project(page: Path, fresh: Path, path: Path, extra: str | None = None) -> Project:
    """A project with the settings the page builds on and its own (and ``extra`` last).

    A page whose own settings install the app is a walkthrough that starts from
    startproject; every other page builds on the README's quickstart settings.
    """
    project = Project(fresh, path)
    steps, _ = settings_of(page)
    if not any("INSTALLED_APPS" in text for _, text in steps):
        base = quickstart_settings()
        project.add_settings(base.source, base.where)
    for block, text in steps:
        project.add_settings(text, block.where)
    # The page's modules exist in every configuration of it (a RESPONSE names one).
    for block in read_blocks(page):
        if block.lang == "python" and block.annotation is None:
            for file_path, text in split_files(block.source):
                if file_path is not None and kind_of(file_path, text) == "module":
                    project.write_module(file_path, text)
    if extra is not None:
        project.add_settings(extra, "the configuration under test")
    return project


def uses_redis(text: str) -> bool:
    return "django_redis" in text or "RedisBackend" in text


# -- the tests ---------------------------------------------------------------------------


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_runs_as_shown(page: Path, fresh_project: Path, tmp_path: Path) -> None:
    blocks = read_blocks(page)
    project = page_project(page, fresh_project, tmp_path / "project")
    commands: list[tuple[Block, str]] = []
    for block in blocks:
        if block.annotation is not None:
            continue
        if block.lang in SHELL_LANGS:
            commands += [(block, line) for line in shell_lines(block)]
            continue
        for file_path, text in split_files(block.source):
            kind = kind_of(file_path, text)
            if kind == "module":
                assert file_path is not None
                project.import_module(file_path, block.where)
            elif kind == "code":
                project.add_code(text, block.where)
    if any(uses_redis(block.source) for block in blocks if block.annotation is None):
        _require_redis()
    project.run_steps()
    for block, line in commands:
        arguments = shlex.split(line)
        assert arguments[:2] == ["python", "manage.py"], (
            f"{block.where}: {line!r} is not a manage.py command: run it here or mark the block "
            f"<!-- test: skip: <why> -->"
        )
        done = project.manage(arguments[2:], stdin="yes\n")
        # On a project where nobody was locked out, "reset NAME --key ..." rightly says it
        # matched nothing (exit 1); test_the_documented_unlock_works unlocks for real.
        nothing_to_reset = arguments[2:4] == ["tokenbucket", "reset"] and "nothing matched" in done.stderr
        assert done.returncode == 0 or nothing_to_reset, f"{block.where}: {line}\n{done.stdout}\n{done.stderr}"


def shell_lines(block: Block) -> list[str]:
    """The commands of a shell block: console blocks' ``$`` lines, every bash line."""
    lines = block.source.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def _configurations() -> list[Any]:
    """Every alternative settings part and fragment alternative, as pytest params."""
    params = []
    for page in PAGES:
        configurations = [(block, text) for block, text in settings_of(page)[1]]
        for block in read_blocks(page):
            if block.lang != "python" or block.annotation is not None:
                continue
            for file_path, text in split_files(block.source):
                try:
                    kind = kind_of(file_path, text)
                except SyntaxError:
                    continue  # test_page_runs_as_shown reports it
                if kind == "fragment":
                    configurations += [
                        (block, f"TOKENBUCKET = {{**TOKENBUCKET, **{alternative}}}\n")
                        for alternative in fragment_alternatives(text)
                    ]
        for number, (block, configuration) in enumerate(configurations, 1):
            marks = [pytest.mark.redis] if uses_redis(configuration) else []
            params.append(pytest.param(page, configuration, id=f"{block.where}#{number}", marks=marks))
    return params


@pytest.mark.parametrize(("page", "configuration"), _configurations())
def test_configuration_works(page: Path, configuration: str, fresh_project: Path, tmp_path: Path) -> None:
    page_project(page, fresh_project, tmp_path / "project", extra=configuration).run_steps()


def _annotated(kind: str) -> list[Any]:
    return [
        pytest.param(block, id=block.where) for page in PAGES for block in read_blocks(page) if block.annotation == kind
    ]


@pytest.mark.parametrize("block", _annotated("skip"))
def test_a_skipped_block_says_why(block: Block) -> None:
    assert len(block.argument.split()) >= 3, f"{block.where}: say why it is not run: <!-- test: skip: <why> -->"


@pytest.mark.parametrize("block", _annotated("syntax"))
def test_a_syntax_only_block_parses(block: Block) -> None:
    assert len(block.argument.split()) >= 3, f"{block.where}: say why it only parses: <!-- test: syntax: <why> -->"
    for file_path, text in split_files(block.source):
        kind_of(file_path, text)  # raises SyntaxError for the page


@pytest.mark.parametrize("block", _annotated("signature"))
def test_a_documented_signature_is_the_real_one(block: Block) -> None:
    module_name, _, attribute = block.argument.rpartition(".")
    documented_object = getattr(importlib.import_module(module_name), attribute)
    call = re.sub(r"\)\s*->.*$", ")", " ".join(block.source.split()))
    name, _, arguments = call.partition("(")
    assert name == attribute, f"{block.where}: documents {name}, annotated as {block.argument}"
    documented = ast.parse(f"def f({arguments[:-1]}): pass").body[0]
    assert isinstance(documented, ast.FunctionDef)
    real = inspect.signature(documented_object)
    assert describe(documented.args) == [
        (p.name, p.kind.name, None if p.default is p.empty else repr(p.default)) for p in real.parameters.values()
    ], f"{block.where}: the documented signature differs from {block.argument}{real}"


def describe(arguments: ast.arguments) -> list[tuple[str, str, str | None]]:
    """(name, kind, repr of the default) of each parameter, as inspect names them."""
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    kinds = ["POSITIONAL_ONLY"] * len(arguments.posonlyargs) + ["POSITIONAL_OR_KEYWORD"] * len(arguments.args)
    described = [
        (a.arg, kind, None if d is None else repr(ast.literal_eval(d)))
        for a, kind, d in zip(positional, kinds, defaults, strict=True)
    ]
    if arguments.vararg:
        described.append((arguments.vararg.arg, "VAR_POSITIONAL", None))
    described += [
        (a.arg, "KEYWORD_ONLY", None if d is None else repr(ast.literal_eval(d)))
        for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]
    if arguments.kwarg:
        described.append((arguments.kwarg.arg, "VAR_KEYWORD", None))
    return described


def test_the_documented_unlock_works(fresh_project: Path, tmp_path: Path) -> None:
    """docs/index.md: a login locked by ``post:username`` is unlocked by its reset command."""
    page = ROOT / "docs" / "index.md"
    project = page_project(page, fresh_project, tmp_path / "project")
    views = next(b for b in read_blocks(page) if "post:username" in b.source and b.lang == "python")
    answering = views.source.replace("(request): ...", "(request):\n    return HttpResponse('ok')")
    project.add_module("myapp/views.py", "from django.http import HttpResponse\n" + answering, views.where)
    unlock = next(
        line for b in read_blocks(page) if b.lang == "console" for line in shell_lines(b) if "reset login" in line
    )
    project.add_code(LOCK_AND_UNLOCK.replace("UNLOCK", repr(shlex.split(unlock)[2:])), "index.md walkthrough")
    output = project.run_steps()
    assert "ok index.md walkthrough" in output, output


def test_the_quick_start_view_answers_429_when_the_limit_is_spent(fresh_project: Path, tmp_path: Path) -> None:
    """README.md's Quick start view, called as a request would: send_message holds 20."""
    page = ROOT / "README.md"
    project = page_project(page, fresh_project, tmp_path / "project")
    project.add_code(QUICK_START_REQUESTS, "README quick start view")
    output = project.run_steps()
    assert "ok README quick start view" in output, output


QUICK_START_REQUESTS = """
from django.contrib.auth import get_user_model
from django.test import RequestFactory
from django_tokenbucket.testing import frozen_clock
from myapp.views import send_message

request = RequestFactory().post("/send/")
request.user = get_user_model().objects.create_user("bob")
with frozen_clock():
    responses = [send_message(request) for _ in range(21)]
assert [r.status_code for r in responses] == [200] * 20 + [429], responses
assert responses[-1]["Retry-After"] == "6"  # 10 a minute: one token every 6 s
"""


# Run by docs_runner in the project: alice is locked out after 5 attempts (whatever the
# address), the documented command unlocks her, and her next attempt is let in.
LOCK_AND_UNLOCK = """
from django.core.management import call_command
from django.test import RequestFactory
from myapp.views import login_view

def attempt(address):
    request = RequestFactory().post("/login/", {"username": "Alice"}, REMOTE_ADDR=address)
    return login_view(request).status_code

codes = [attempt(f"198.51.100.{i}") for i in range(6)]
assert codes == [200] * 5 + [429], codes
call_command(*UNLOCK)
assert attempt("198.51.100.99") == 200
"""


def _require_redis() -> None:
    import socket

    try:
        socket.create_connection((settings.REDIS_HOST, settings.REDIS_PORT), timeout=2).close()
    except OSError:
        message = f"Redis is not reachable at {settings.REDIS_HOST}:{settings.REDIS_PORT}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and {message}")
        pytest.skip(message)


#: What a newcomer's Python has before any ``pip install``: the standard library, pip,
#: and what installing this package brings.
PRESENT_MODULES = set(sys.stdlib_module_names) | {"pip", "django"}


def _python_modules_run_before_install(block: Block) -> list[str]:
    """The ``python -m <module>`` of ``block`` whose module no earlier line installed."""
    missing, installed = [], set()
    for line in shell_lines(block):
        for command in re.split(r"&&|;|\|\|", line):
            words = command.split()
            if words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]:
                installed |= {re.split(r"[\[<>=!~ ]", word.strip("'\""))[0] for word in words if not word.startswith("-")}
            elif len(words) > 2 and re.fullmatch(r"python(3(\.\d+)?)?", words[0]) and words[1] == "-m":
                module = words[2].split(".")[0]
                if module not in PRESENT_MODULES and module not in installed:
                    missing.append(f"{block.where}: {command.strip()}")
    return missing


def test_a_shell_block_installs_what_it_runs_with_python_m() -> None:
    # The README once said "python -m build" to a newcomer without "pip install build" (issue 33).
    blocks = [block for page in PAGES for block in read_blocks(page) if block.lang in SHELL_LANGS]
    assert [where for block in blocks for where in _python_modules_run_before_install(block)] == []


def test_the_install_check_finds_a_module_never_installed() -> None:
    def block(source: str) -> Block:
        return Block(ROOT / "README.md", 1, "bash", source)

    assert _python_modules_run_before_install(block("python -m build .\n")) == ["README.md:1: python -m build ."]
    assert _python_modules_run_before_install(block("pip install build && python -m build .\n")) == []
    assert _python_modules_run_before_install(block("python3 -m pip install 'build>=1'\npython3 -m build\n")) == []
    assert _python_modules_run_before_install(block("python -m venv .venv && python -m django --version\n")) == []


#: Settings files that are not startproject's: a tuple-style one on MySQL with options of
#: its own (mozmeao/basket's shape), and a PostgreSQL one.
OTHER_SETTINGS = {
    "tuples and MySQL options": {
        "INSTALLED_APPS": ("django.contrib.auth", "django.contrib.contenttypes"),
        "MIDDLEWARE": ("django.middleware.common.CommonMiddleware",),
        "DATABASES": {
            "default": {
                "ENGINE": "django.db.backends.mysql",
                "OPTIONS": {"init_command": "SET sql_mode='STRICT_TRANS_TABLES'"},
            }
        },
    },
    "PostgreSQL": {
        "INSTALLED_APPS": ["django.contrib.auth", "django.contrib.contenttypes"],
        "MIDDLEWARE": ["django.middleware.common.CommonMiddleware"],
        "DATABASES": {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "app"}},
    },
}
_PASTED = ("INSTALLED_APPS", "MIDDLEWARE", "DATABASES")


def _installing_blocks() -> list[Any]:
    found = []
    for page in PAGES:
        for block in read_blocks(page):
            if block.lang != "python" or block.annotation in ("skip", "syntax"):
                continue
            for path, text in split_files(block.source):
                try:
                    ast.parse(text)
                except SyntaxError:
                    continue  # a fragment of a dict, merged into TOKENBUCKET by the page test
                # Snippets that change a setting the file has (a whole new DATABASES for
                # SQLite is a definition, not a paste).
                changes = any(f"{n}[" in text or f"*{n}" in text or f"{n} +=" in text for n in _PASTED)
                if kind_of(path, text) == "settings" and changes:
                    found.append(pytest.param(text, id=block.where))
    return found


@pytest.mark.parametrize("shape", sorted(OTHER_SETTINGS))
@pytest.mark.parametrize("text", _installing_blocks())
def test_an_install_snippet_pastes_into_any_settings_file(text: str, shape: str) -> None:
    """Issue 49: ``INSTALLED_APPS += [...]`` raised TypeError on a tuple, and an unconditional
    ``DATABASES["default"]["OPTIONS"] = {...}`` replaced a MySQL project's options and broke
    PostgreSQL ("invalid connection option transaction_mode")."""
    import copy

    namespace: dict[str, Any] = copy.deepcopy(OTHER_SETTINGS[shape])
    before = copy.deepcopy(namespace)
    namespace.setdefault("TOKENBUCKET", {})
    namespace.setdefault("REST_FRAMEWORK", {})
    exec(compile(text, "<snippet>", "exec"), namespace)
    for name in ("INSTALLED_APPS", "MIDDLEWARE"):
        assert set(before[name]) <= set(namespace[name]), name  # added to, never replaced
    if "django_tokenbucket" in text and "INSTALLED_APPS" in text:
        assert "django_tokenbucket" in namespace["INSTALLED_APPS"]
    options = namespace["DATABASES"]["default"].get("OPTIONS", {})
    assert before["DATABASES"]["default"].get("OPTIONS", {}).items() <= options.items()
    assert "transaction_mode" not in options  # an SQLite option: PostgreSQL and MySQL refuse it
