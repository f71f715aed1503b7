from importlib import import_module
from importlib.util import find_spec

from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.translation import gettext_lazy as _

from . import lifecycle

#: What ``ready()`` loads, each when the framework it needs is installed (None: always):
#: the system checks of the core and of each integration, and the Celery tasks, which
#: register the ``django_tokenbucket.*`` tasks with the project's Celery app so that
#: workers know them without autodiscovery. Modules load models, which exist only from
#: ``ready()`` on: Django's way, as its admin's autodiscovery.
READY_MODULES = (
    (None, "django_tokenbucket.checks"),
    (None, "django_tokenbucket.compat.ratelimit.checks"),
    # Login protection's receivers of Django's authentication signals, and its checks.
    (None, "django_tokenbucket.auth.receivers"),
    (None, "django_tokenbucket.auth.checks"),
    ("rest_framework", "django_tokenbucket.throttling.checks"),
    ("celery", "django_tokenbucket.celery.checks"),
    ("celery", "django_tokenbucket.tasks"),
)


class TokenBucketConfig(AppConfig):
    name = "django_tokenbucket"
    verbose_name = _("Rate limits")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        for requirement, module in READY_MODULES:
            if requirement is None or find_spec(requirement) is not None:
                import_module(module)
        post_migrate.connect(lifecycle.tables_emptied, sender=self)
