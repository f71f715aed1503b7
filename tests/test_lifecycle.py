"""One settings object and one lifecycle (issue 50, item 3): each feature's options parsed
once, read the same way by the feature and its check, and let go when the setting changes."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_tokenbucket import analytics, deny_cache, lifecycle, overrides
from django_tokenbucket.auth import config
from django_tokenbucket.settings import DEFAULTS, tokenbucket_settings

BASE = settings.TOKENBUCKET


def test_each_feature_is_parsed_once_and_again_when_the_setting_changes():
    with override_settings(TOKENBUCKET={**BASE, "DENY_CACHE": {"MAX_AGE": 2}, "ANALYTICS": {"FLUSH": 30}}):
        memory = deny_cache.active()
        assert memory is deny_cache.active() is tokenbucket_settings.deny_cache
        assert memory is not None and memory.max_age == 2_000_000
        counting = analytics.active()
        assert counting is not None and counting.flush == 30.0
    with override_settings(TOKENBUCKET={**BASE, "DENY_CACHE": False, "OVERRIDES": False, "LOGIN": None}):
        assert deny_cache.active() is None
        assert overrides.active() is None
        assert config.configured() is None
        assert analytics.active() is None


def test_the_defaults_are_the_one_table():
    # Each feature's default is the DEFAULTS entry, parsed, whoever reads it.
    with override_settings(TOKENBUCKET={"LIMITS": BASE["LIMITS"]}):
        memory, snapshot = deny_cache.active(), overrides.active()
        assert memory is not None and memory.max_age == DEFAULTS["DENY_CACHE"]["MAX_AGE"] * 1_000_000
        assert memory.max_keys == DEFAULTS["DENY_CACHE"]["MAX_KEYS"]
        assert snapshot is not None and snapshot.max_age == DEFAULTS["OVERRIDES"]["MAX_AGE"]
        assert snapshot.keep_expired == DEFAULTS["OVERRIDES"]["KEEP_EXPIRED"]


def test_a_malformed_feature_raises_at_every_read_with_the_message_its_check_gives():
    with override_settings(TOKENBUCKET={**BASE, "DENY_CACHE": {"MAX_AGE": 0}}):
        for _ in range(2):  # a failed parse is not kept
            with pytest.raises(ImproperlyConfigured) as raised:
                deny_cache.active()
        [check] = [m for m in run_checks() if m.id == "django_tokenbucket.E051"]
        assert str(raised.value) in check.msg
    assert deny_cache.active() is not None


def test_a_module_never_imported_is_skipped(monkeypatch):
    # The tables name modules: one not loaded holds nothing, and is not imported to reset it.
    missing = "django_tokenbucket.no_such_module"
    monkeypatch.setattr(lifecycle, "ON_SETTING_CHANGED", ((missing, "settings_changed", lifecycle.TOKENBUCKET),))
    monkeypatch.setattr(lifecycle, "AFTER_FORK", ((missing, "after_fork_in_child"),))
    lifecycle.setting_changed_receiver(setting="TOKENBUCKET")
    lifecycle.after_fork_in_child()
