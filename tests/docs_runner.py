"""Run documentation snippets inside a throwaway project (see tests/test_docs.py).

Copied into the project and run there, by its own interpreter, as ``python docs_runner.py
STEPS.json``: a user's project is a separate process with its own settings module, and
so is this. Each step's outcome is printed; the first failure exits 1 with the traceback
and the snippet's place in the docs.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any


def given_names() -> dict[str, Any]:
    """The names a snippet may use without defining them: what the prose around it names.

    A snippet of a view's body speaks of "the user", "the client's address" or "the
    tenant"; these are real objects of the throwaway project, so a snippet that misuses
    one (a model instead of its pk as a key, say) fails as it would for a user.
    """
    from django.contrib.auth import get_user_model
    from django.db import transaction
    from django.http import HttpResponse, JsonResponse
    from django.shortcuts import render
    from django.test import RequestFactory
    from django.utils.decorators import method_decorator
    from django.views import View

    user, _ = get_user_model().objects.get_or_create(username="alice")
    request = RequestFactory().post("/login/", {"username": "alice"}, REMOTE_ADDR="203.0.113.7")
    request.user = user
    tenant = SimpleNamespace(pk=7)
    request.tenant = tenant  # type: ignore[attr-defined]
    return {
        "user": user,
        "uid": user.pk,
        "ip": "203.0.113.7",
        "tenant": tenant,
        "tenant_id": tenant.pk,
        "request": request,
        "transaction": transaction,
        "HttpResponse": HttpResponse,
        "JsonResponse": JsonResponse,
        "render": render,
        "View": View,
        "method_decorator": method_decorator,
    }


def _needs_a_function(tree: ast.Module) -> str | None:
    """Return "def" or "async def" when the snippet is a function's body (a bare return/await)."""
    found: set[type] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return
        if isinstance(node, (ast.Return, ast.Await)):
            found.add(type(node))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    if ast.Await in found:
        return "async def"
    return "def" if ast.Return in found else None


def run_code(source: str, where: str, namespace: dict[str, Any]) -> None:
    tree = ast.parse(source, filename=where)
    wrapper = _needs_a_function(tree)
    if wrapper is None:
        exec(compile(tree, where, "exec"), namespace)
        return
    # The snippet is the body of a view: run it as one, with the names it uses visible.
    body = "\n".join("    " + line for line in source.splitlines())
    exec(compile(f"{wrapper} _snippet():\n{body}\n", where, "exec"), namespace)
    result = namespace.pop("_snippet")()
    if asyncio.iscoroutine(result):
        asyncio.run(result)


def smoke_limits() -> None:
    """Ask every configured limit once: the backend answers with these settings."""
    from django_tokenbucket import limiter
    from django_tokenbucket.settings import tokenbucket_settings

    for name in tokenbucket_settings.LIMITS:
        status = limiter.check(name, key="docs-smoke")
        assert status.ok, f"a fresh key of {name!r} is refused: {status}"


def main() -> int:
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    call_command("check", fail_level="WARNING")
    namespace = given_names()
    with open(sys.argv[1]) as file:
        steps = json.load(file)
    for step in steps:
        where = step["where"]
        try:
            if step["kind"] == "code":
                run_code(step["source"], where, namespace)
            elif step["kind"] == "import":
                importlib.import_module(step["module"])
            elif step["kind"] == "smoke":
                smoke_limits()
        except BaseException:
            print(f"FAILED {where}:\n{traceback.format_exc()}", flush=True)
            return 1
        print(f"ok {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
