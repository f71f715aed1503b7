"""A stand-in for a paid LLM API: deterministic, offline, and billed in tokens.

Real providers bill prompt and completion tokens; a request reserves the worst case
(the whole prompt plus ``max_tokens`` of answer) and returns what it did not use.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

#: Tokens a summary may use at most (the ``max_tokens`` of the request).
MAX_SUMMARY_TOKENS = 400
#: Longest text accepted: its worst case must fit the limit's capacity plus max_reserved.
MAX_TEXT_LENGTH = 40_000


def count_tokens(text: str) -> int:
    """Return the tokens of ``text`` (about four characters each, as for English)."""
    return max(1, math.ceil(len(text) / 4))


def worst_case_tokens(text: str) -> int:
    """Return the tokens a summary of ``text`` may cost: the prompt and the longest answer."""
    return count_tokens(text) + MAX_SUMMARY_TOKENS


@dataclass(frozen=True)
class Completion:
    text: str
    total_tokens: int


def summarise(text: str) -> Completion:
    """Return the first sentences of ``text``, taking a moment as a real model would."""
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    summary = ""
    for sentence in sentences:
        if summary and count_tokens(summary + " " + sentence) > MAX_SUMMARY_TOKENS // 4:
            break
        summary = f"{summary} {sentence}".strip()
    summary = summary[: MAX_SUMMARY_TOKENS * 4]
    time.sleep(min(2.0, 0.2 + count_tokens(text) / 10_000))
    return Completion(summary, count_tokens(text) + count_tokens(summary))
