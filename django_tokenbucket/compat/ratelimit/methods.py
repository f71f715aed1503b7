"""The ``method`` sentinels of django-ratelimit's API: ``ALL`` and ``UNSAFE``.

Re-exported by the package (``django_tokenbucket.compat.ratelimit``), where
django-ratelimit's users import them from.
"""

__all__ = ["ALL", "UNSAFE"]

#: Every HTTP method (a sentinel, as in django-ratelimit).
ALL = (None,)
#: The methods that change something.
UNSAFE = ["DELETE", "PATCH", "POST", "PUT"]
