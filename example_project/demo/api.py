"""The DRF API: throttled by ``REST_FRAMEWORK["DEFAULT_THROTTLE_CLASSES"]`` (see settings.py)."""

from __future__ import annotations

import random

from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_tokenbucket.ip import client_ip

QUOTES = [
    ("Premature optimization is the root of all evil.", "Donald Knuth"),
    ("Simple things should be simple, complex things should be possible.", "Alan Kay"),
    ("Make it work, make it right, make it fast.", "Kent Beck"),
    ("There are only two hard things in computer science: cache invalidation and naming things.", "Phil Karlton"),
    ("Programs must be written for people to read, and only incidentally for machines to execute.", "Harold Abelson"),
    ("Errors should never pass silently.", "Tim Peters"),
]


class QuoteView(APIView):
    """A random quote about programming.

    Every request takes a token from two buckets of the caller (the user, or the
    address when anonymous): "burst" (5, refilled at one per 2 s) and "sustained"
    (100, refilled at one per 36 s). Both must have one; a denied request takes none.
    Look at the RateLimit headers, and at Retry-After on a 429.
    """

    def get(self, request: Request) -> Response:
        text, author = random.choice(QUOTES)
        if request.user.is_authenticated:
            caller = f"user {request.user.get_username()}"
        else:
            caller = f"anonymous, by address {client_ip(request)}"
        return Response({"quote": text, "author": author, "throttled_as": caller})
