"""A plan the limiter abandons at a failed step is closed there, not by the garbage collector.

``limiter.reset()`` on a store that fails raises at its ``Reset`` step; the plan's
``finally`` (forgetting the key in the deny cache, and at commit) used to wait for a
collection, which could start anywhere — once inside ``get_backend``'s lock, whose
finalizer then asked for a backend again and deadlocked a CI run.
"""

from __future__ import annotations

import gc
import inspect

import pytest
from django.test import override_settings

from django_tokenbucket import BackendUnavailable, limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.engine import state

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])


def suspended_plans() -> list[object]:
    plans = (state.reset.__code__, state.refunded.__code__)
    return [o for o in gc.get_objects() if inspect.isgenerator(o) and o.gi_code in plans and o.gi_frame is not None]


@pytest.mark.parametrize("call", ["reset", "areset"])
def test_a_reset_that_fails_leaves_no_plan_behind(call):
    failing = {**BASE_SETTINGS, "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}
    gc.disable()
    try:
        with override_settings(TOKENBUCKET=failing):
            get_backend()
            with pytest.raises(BackendUnavailable, match="the store failed"):
                if call == "reset":
                    limiter.reset("login", "k")
                else:
                    from asgiref.sync import async_to_sync

                    async_to_sync(limiter.areset)("login", "k")
            assert suspended_plans() == []
    finally:
        gc.enable()
