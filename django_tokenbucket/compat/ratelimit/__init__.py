"""django-ratelimit 4.1's API, decided exactly by django_tokenbucket's backends.

Migrating is replacing the import prefix ``django_ratelimit`` with
``django_tokenbucket.compat.ratelimit``::

    from django_tokenbucket.compat.ratelimit.decorators import ratelimit
    from django_tokenbucket.compat.ratelimit.core import is_ratelimited, get_usage
    from django_tokenbucket.compat.ratelimit.exceptions import Ratelimited
    from django_tokenbucket.compat.ratelimit import ALL, UNSAFE

The decorator, the functions and the ``RATELIMIT_*`` settings mean what django-ratelimit
documents: fixed windows that start at a per-key offset, ``group``, key and rate
callables, masks, ``block=True`` raising ``Ratelimited``. Each count is a fixed-window
decision of the limiter, atomic in the database (or Redis), so concurrent requests
never overshoot. The differences, each deliberate, are listed in docs/migrating.md.
"""

from .methods import ALL, UNSAFE

#: The django-ratelimit release whose API this stands in for, so that code comparing
#: ``django_ratelimit.VERSION`` keeps its answer after the swap.
VERSION = (4, 1, 0)
__version__ = ".".join(map(str, VERSION))

__all__ = ["ALL", "UNSAFE", "VERSION"]
