"""Database router of the test settings."""

from __future__ import annotations

from typing import Any


class OnlyDefaultIsMigrated:
    """Migrate "default" only: the other aliases mirror it (or are never reached).

    Django 6's system checks read the server of every alias that models migrate to, and on
    MySQL/MariaDB that means connecting: to a mirror pointed at a fault proxy, or from a
    test without database access, it must not.
    """

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return None if db == "default" else False
