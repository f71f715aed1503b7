"""How a reservation stores its task: the signature as JSON, read back as Celery sent it.

Celery's own JSON encoding (kombu's) keeps dates, UUIDs and decimals; a string holding
NUL characters is stored as its parts, since PostgreSQL's JSON refuses ``\\u0000``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from celery.canvas import Signature
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

__all__ = ["dump_signature", "load_signature", "publish_options"]


def dump_signature(sig: Signature) -> dict[str, Any]:
    """Return the signature as JSON, with Celery's own encoding of dates, UUIDs and decimals."""
    data = {
        "task": sig.task,
        "args": list(sig.args or ()),
        "kwargs": dict(sig.kwargs or {}),
        "options": dict(sig.options or {}),
    }
    try:
        stored: dict[str, Any] = _without_nul(json.loads(kombu_dumps(data)), sig.task)  # type: ignore[no-untyped-call]
    except TypeError as exc:
        raise TypeError(
            f"the arguments and options of {sig.task!r} must be JSON-serializable to be stored: {exc}"
        ) from None
    return stored


def load_signature(stored: Mapping[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = kombu_loads(json.dumps(_with_nul(stored)))  # type: ignore[no-untyped-call]
    return loaded


#: A string that held NUL characters, stored as its NUL-free parts: PostgreSQL's JSON
#: refuses \u0000, and an argument such as a submitted username may hold one.
_NUL_PARTS = "__tokenbucket_nul_parts__"


def _without_nul(value: Any, task: str) -> Any:
    if isinstance(value, str):
        return {_NUL_PARTS: value.split("\x00")} if "\x00" in value else value
    if isinstance(value, list):
        return [_without_nul(item, task) for item in value]
    if isinstance(value, dict):
        if any("\x00" in key for key in value):
            raise ValueError(
                f"the arguments of {task!r} hold a dictionary key with a NUL character: it cannot be stored"
            )
        return {key: _without_nul(item, task) for key, item in value.items()}
    return value


def _with_nul(value: Any) -> Any:
    if isinstance(value, list):
        return [_with_nul(item) for item in value]
    if isinstance(value, dict):
        if len(value) == 1 and isinstance(value.get(_NUL_PARTS), list):
            return "\x00".join(value[_NUL_PARTS])
        return {key: _with_nul(item) for key, item in value.items()}
    return value


def publish_options(stored: Mapping[str, Any]) -> dict[str, Any]:
    """Return the publishing options (queue, priority, time limits...) of a stored signature."""
    return dict(load_signature(stored).get("options") or {})
