"""Waiting for acquired tokens, and giving them back when the wait is abandoned.

``limiter.acquire()`` reserves tokens, then sleeps until they exist. A caller that stops
waiting never uses them: an async view whose client went away (Django cancels it), an
``asyncio.timeout`` around the call, a Celery soft time limit or another signal raising
inside a sleeping thread. Left reserved, every abandoned wait would push each later
caller back by its tokens: five cancelled waits on a token-a-minute limit cost the next
caller five minutes (issue 47, item 7). So the tokens go back, once.

An asyncio cancellation may land at any await of ``aacquire``:

- before the store call: nothing was reserved, nothing goes back;
- during it: the store may have reserved without the caller learning so (the database
  call goes on in its thread whatever happens to the coroutine; the Redis script may have
  run while its reply was on its way). The call is therefore shielded: it always
  finishes and its answer is read, and what it reserved goes back then;
- during the sleep: the reservation is known, and goes back.

The give-back runs in a task of its own, which a second cancellation does not stop (it
only stops the cancelled caller from waiting for it), and each wait gives back at most
once. A store call that itself failed ambiguously (a timeout after the script was sent)
leaves nothing known to give back, as for any call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .status import Status

__all__ = ["aacquired", "slept", "took_tokens"]

logger = logging.getLogger("django_tokenbucket")

#: Give-backs under way. The event loop keeps only weak references to tasks, and a
#: give-back outlives the cancelled caller that started it.
_giving_back: set[asyncio.Task[None]] = set()


def took_tokens(status: Status) -> bool:
    """Whether an allowed call took tokens from the store: not when it failed open, was let
    through by a shadow limit that would have denied it, or by an exemption (nothing asked
    the store). Giving back what was not taken would mint tokens."""
    return status.ok and status.value is not None and not (status.failed_open or status.would_deny)


async def aacquired(
    decide: Coroutine[Any, Any, Status],
    wait_for: Callable[[Status], float],
    give_back: Callable[[Status], Awaitable[object]],
) -> Status:
    """Await the reservation ``decide`` makes, then sleep ``wait_for(status)`` seconds.

    Cancelled at any point, what the reservation took is handed to ``give_back`` (once)
    before the cancellation goes on.
    """
    decision = asyncio.ensure_future(decide)
    try:
        status = await asyncio.shield(decision)
    except asyncio.CancelledError:
        await asyncio.shield(_in_background(_give_back_once_decided(decision, give_back)))
        raise
    wait = wait_for(status)
    if wait:
        try:
            await asyncio.sleep(wait)
        except asyncio.CancelledError:
            await asyncio.shield(_in_background(_give_back(status, give_back)))
            raise
    return status


def slept(wait: float, status: Status, give_back: Callable[[Status], object]) -> None:
    """Sleep ``wait`` seconds for the tokens ``status`` reserved; give them back if the
    sleep is interrupted (a signal handler raising: Celery's soft time limit, Ctrl-C)."""
    try:
        time.sleep(wait)
    except BaseException:
        if took_tokens(status):
            try:
                give_back(status)
            except Exception as exc:  # the caller's own interruption matters more
                _lost(status, exc)
        raise


def _in_background(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.ensure_future(coroutine)
    _giving_back.add(task)
    task.add_done_callback(_giving_back.discard)
    return task


async def _give_back_once_decided(
    decision: asyncio.Future[Status], give_back: Callable[[Status], Awaitable[object]]
) -> None:
    try:
        status = await decision
    except (Exception, asyncio.CancelledError):  # refused, failed or never run: nothing reserved
        return
    await _give_back(status, give_back)


async def _give_back(status: Status, give_back: Callable[[Status], Awaitable[object]]) -> None:
    if not took_tokens(status):
        return
    try:
        await give_back(status)
    except Exception as exc:  # nobody is left to raise to: the tokens refill on their own
        _lost(status, exc)


def _lost(status: Status, exc: Exception) -> None:
    logger.warning(
        "rate limit %r: an abandoned acquire could not give its %g tokens back (they refill on their own): %s",
        status.name,
        status.count,
        exc,
    )
