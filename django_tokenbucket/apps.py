from importlib.util import find_spec

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class TokenBucketConfig(AppConfig):
    name = "django_tokenbucket"
    verbose_name = _("Rate limits")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Django's way: these import models, which exist only from here on.
        from . import checks  # noqa: F401  (registers the system checks)

        if find_spec("celery") is not None:
            # Registers the django_tokenbucket.* tasks with the project's Celery app, so that
            # workers know them without autodiscovery.
            from . import tasks  # noqa: F401
