"""The DRF API's throttles: a short burst and a sustained rate per user, decided together.

Both are ``django_tokenbucket.throttling.UserRateThrottle`` on their own scope (rates
in ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]``), so a request is allowed only when
both buckets have a token, and a denied request spends neither.
"""

from django_tokenbucket.throttling import UserRateThrottle


class BurstRateThrottle(UserRateThrottle):
    scope = "burst"


class SustainedRateThrottle(UserRateThrottle):
    scope = "sustained"
