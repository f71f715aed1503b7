"""Replace the PostgreSQL fast path's functions with version 2 (other databases: nothing).

Version 2 decides a clock slightly behind the stored time (a host whose clock lags
another's) at the stored time, as ``algorithms`` now does. Code still calling version 1
during a deployment finds it gone and takes the portable path, which is always correct.
"""

from typing import Any

from django.db import migrations

OLD, NEW = 1, 2


def upgrade(apps: Any, schema_editor: Any) -> None:
    from django_tokenbucket.backends.postgresql import drop_sql, functions_sql, is_postgresql

    if not is_postgresql(schema_editor.connection):
        return
    schema_editor.execute(functions_sql(NEW), params=None)
    schema_editor.execute(drop_sql(OLD), params=None)


def downgrade(apps: Any, schema_editor: Any) -> None:
    from django_tokenbucket.backends.postgresql import drop_sql, functions_sql, is_postgresql

    if not is_postgresql(schema_editor.connection):
        return
    schema_editor.execute(functions_sql(OLD), params=None)
    schema_editor.execute(drop_sql(NEW), params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("django_tokenbucket", "0004_postgresql_fast_path"),
    ]

    operations = [
        migrations.RunPython(upgrade, downgrade, elidable=False),
    ]
