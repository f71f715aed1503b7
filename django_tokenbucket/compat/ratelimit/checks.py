"""System checks of the django-ratelimit compatibility layer: the ``RATELIMIT_*`` settings it reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.cache import caches
from django.urls import URLResolver, get_resolver
from django.utils.module_loading import import_string

from ... import catalogue
from . import stores
from .decorators import MARK
from .keys import ip_meta_key_problem

__all__ = ["check_ratelimit_compat"]

_PACKAGE = __name__.rpartition(".")[0]


@checks.register(checks.Tags.caches)
def check_ratelimit_compat(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check the ``RATELIMIT_*`` settings read by ``django_tokenbucket.compat.ratelimit``."""
    messages: list[checks.CheckMessage] = []
    alias = stores.cache_alias()
    configured = getattr(settings, "CACHES", {})
    if alias not in configured:
        if stores.use_cache_is_set():
            messages.append(catalogue.E040(alias=alias))
        # A missing "default" is Django's own caches.E001.
    else:
        try:
            where = stores.home(caches[alias])
        except Exception:  # a cache that cannot be built is reported by Django's own checks
            where = None
        if where == "tokenbucket" and _in_use():
            named = "RATELIMIT_USE_CACHE"
            if not stores.use_cache_is_set():
                named += " unset: the default cache"
            messages.append(catalogue.W040(alias=alias, named=named, backend=configured[alias].get("BACKEND", "")))
    for setting, bits in (("RATELIMIT_IPV4_MASK", 32), ("RATELIMIT_IPV6_MASK", 128)):
        mask = getattr(settings, setting, bits if bits == 32 else 64)
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask <= bits:
            messages.append(catalogue.E041(setting=setting, bits=bits, value=mask))
    source = getattr(settings, "RATELIMIT_IP_META_KEY", None)
    problem = ip_meta_key_problem(source)
    if problem is not None:
        messages.append(catalogue.E043(value=source, header=problem.header, missing=problem.missing, fix=problem.fix))
    exception_class = getattr(settings, "RATELIMIT_EXCEPTION_CLASS", None)
    if isinstance(exception_class, str):
        try:
            import_string(exception_class)
        except ImportError as exc:
            messages.append(catalogue.E042(value=exception_class, error=exc))
    return messages


def _in_use() -> bool:
    """Whether the project uses the layer: it sets a ``RATELIMIT_*`` setting, lists the
    layer's middleware, or routes a URL to a view decorated with its ``ratelimit``.

    Where the layer keeps its limits is worth a warning only to a project that uses it:
    every other project's default cache is none of its business. Read from settings and
    the URLconf, not from what happens to be imported, so the answer is the same in
    ``manage.py check`` and in a test run that imported everything.
    """
    if any(name.startswith("RATELIMIT_") for name in dir(settings)):
        return True
    if any(str(path).startswith(_PACKAGE + ".") for path in getattr(settings, "MIDDLEWARE", None) or ()):
        return True
    try:
        views = list(_views(get_resolver().url_patterns))
    except Exception:  # a broken URLconf is reported by Django's own URL checks
        return False
    return any(_decorated(view) for view in views)


def _views(patterns: Iterable[Any]) -> Iterator[Callable[..., Any]]:
    """Yield every view the URL patterns route to."""
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _views(pattern.url_patterns)
        else:
            yield pattern.callback


def _decorated(view: Callable[..., Any]) -> bool:
    """Whether ``view``, a method of its class (``as_view()``), or a function one of those
    closes over (DRF's ``@api_view`` handlers call the function without ``wraps``) carries the mark."""
    candidates: list[Any] = [view]
    for view_class in (getattr(view, "view_class", None), getattr(view, "cls", None)):
        if isinstance(view_class, type):
            candidates += [attr for klass in view_class.__mro__ for attr in vars(klass).values() if callable(attr)]
    candidates += [
        contents
        for candidate in list(candidates)
        for cell in getattr(candidate, "__closure__", None) or ()
        if callable(contents := _contents(cell))
    ]
    for candidate in candidates:
        seen = 0
        while candidate is not None and seen < 100:  # bounded: a __wrapped__ chain may loop
            if getattr(candidate, MARK, False) is True:
                return True
            candidate, seen = getattr(candidate, "__wrapped__", None), seen + 1
    return False


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled (a closure over a name assigned later)
        return None
