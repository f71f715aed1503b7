"""Install the PostgreSQL fast path's server-side functions (other databases: nothing)."""

from typing import Any

from django.db import migrations

#: Each migration installs the version it was written for, never the current one.
VERSION = 1


def install(apps: Any, schema_editor: Any) -> None:
    from django_tokenbucket.backends.postgresql import functions_sql, is_postgresql

    if not is_postgresql(schema_editor.connection):
        return
    schema_editor.execute(functions_sql(VERSION), params=None)


def uninstall(apps: Any, schema_editor: Any) -> None:
    from django_tokenbucket.backends.postgresql import drop_sql, is_postgresql

    if not is_postgresql(schema_editor.connection):
        return
    schema_editor.execute(drop_sql(VERSION), params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("django_tokenbucket", "0003_reservation"),
    ]

    operations = [
        migrations.RunPython(install, uninstall, elidable=False),
    ]
