"""Compatibility layers: other libraries' APIs, decided by django_tokenbucket.

``django_tokenbucket.compat.ratelimit`` stands in for ``django_ratelimit``: change the
import prefix and nothing else.
"""
