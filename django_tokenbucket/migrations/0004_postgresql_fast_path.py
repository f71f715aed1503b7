"""Install the PostgreSQL fast path's SQL functions (other databases: nothing).

A later change of behaviour ships as a new version of the functions with a migration of
its own, which installs the new version and drops this one: code calling a version the
schema lacks takes the portable path, which is always correct.
"""

from typing import Any

from django.db import migrations

from django_tokenbucket.backends.database.postgresql import drop_sql, functions_sql, is_postgresql

#: Each migration installs the version it was written for, never the current one.
VERSION = 3


def install(apps: Any, schema_editor: Any) -> None:
    if is_postgresql(schema_editor.connection):
        schema_editor.execute(functions_sql(VERSION), params=None)


def uninstall(apps: Any, schema_editor: Any) -> None:
    if is_postgresql(schema_editor.connection):
        schema_editor.execute(drop_sql(VERSION), params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("django_tokenbucket", "0003_reservation"),
    ]

    operations = [
        migrations.RunPython(install, uninstall, elidable=False),
    ]
