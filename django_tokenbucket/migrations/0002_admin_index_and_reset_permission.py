from typing import Any

from django.db import migrations, models


class AddIndexWithoutBlockingWrites(migrations.AddIndex):
    """AddIndex that builds the index CONCURRENTLY on PostgreSQL.

    Every rate-limited request writes to this table: a plain CREATE INDEX would block
    them all while it runs. MySQL/MariaDB build secondary indexes online anyway.
    """

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.add_index(model, self.index, concurrently=True)
        else:
            schema_editor.add_index(model, self.index)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        model = from_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.remove_index(model, self.index, concurrently=True)
        else:
            schema_editor.remove_index(model, self.index)


class CreateDebtIndex(migrations.operations.base.Operation):
    """A partial index of the rows in debt (value < 0), where the database has them.

    The admin's "limited now" and "partially used" filters look at the rows written
    recently (an index range on name_ts) and at the rows in debt, which are few; this
    index finds those without reading the table. MySQL/MariaDB have no partial
    indexes: there, those filters read the rows of the limit. Not part of the model
    state, since it only speeds up a query and does not exist on every database.
    """

    reduces_to_sql = True
    reversible = True
    name = "django_tokenbucket_debt"

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        vendor = schema_editor.connection.vendor
        if vendor not in ("postgresql", "sqlite"):
            return
        concurrently = " CONCURRENTLY" if vendor == "postgresql" else ""
        schema_editor.execute(
            f"CREATE INDEX{concurrently} {self.name} ON django_tokenbucket_ratelimit (name, ts) WHERE value < 0"
        )

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor in ("postgresql", "sqlite"):
            schema_editor.execute(f"DROP INDEX IF EXISTS {self.name}")

    def describe(self) -> str:
        return "Create the partial index of rate-limit rows in debt (PostgreSQL, SQLite)"


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY cannot run inside a transaction.
    atomic = False

    dependencies = [
        ("django_tokenbucket", "0001_initial"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="ratelimit",
            options={
                "permissions": [("reset_ratelimit", "Can reset rate limits")],
                "verbose_name": "rate limit",
                "verbose_name_plural": "rate limits",
            },
        ),
        AddIndexWithoutBlockingWrites(
            model_name="ratelimit",
            index=models.Index(fields=["name", "-ts", "-id"], name="django_tokenbucket_name_ts"),
        ),
        CreateDebtIndex(),
    ]
