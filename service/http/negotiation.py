"""The ``Accept`` header, read one way for every answer a request can get (RFC 9110 §12.5.1).

A header is a list of media ranges (``type/subtype``, ``type/*`` or ``*/*``), each with an
optional weight ``q`` from 0 to 1 (``q=0``: not acceptable). Types and parameter names are
matched whatever their case. A part that is not a media range is left out, and a ``q`` that is
not a weight from 0 to 1 makes its range not acceptable: a malformed header is never an error.

An endpoint answers JSON unless the client names one of its other answers (safetensors, a
streamed rollout) with a ``q`` above 0 and at least JSON's; a wildcard stands for JSON, so a
client that sends ``*/*`` gets JSON. No header, or one that accepts none of them, gets JSON too
(rather than 406: the JSON answer says what went wrong in a form every client reads).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")  # RFC 9110's token, lowered
_PLAIN = frozenset({"", "*/*", "application/json"})  # what most clients send: never parsed


class MediaRange(NamedTuple):
    """One range of an ``Accept`` header: lower-case ``type`` and ``subtype`` (either may be
    ``*``), and its weight ``q``."""

    type: str
    subtype: str
    q: float


def parse_accept(header: str | None) -> list[MediaRange]:
    """The media ranges of ``header``, highest ``q`` first (equal weights keep the header's
    order); parts that are not media ranges are left out."""
    ranges = []
    for part in (header or "").split(","):
        found = _media_range(part)
        if found is not None:
            ranges.append(found)
    ranges.sort(key=lambda r: -r.q)  # stable
    return ranges


def _media_range(part: str) -> MediaRange | None:
    media, *params = part.split(";")
    kind, slash, sub = media.strip().lower().partition("/")
    if not (slash and _TOKEN.fullmatch(kind) and _TOKEN.fullmatch(sub)):
        return None
    if kind == "*" and sub != "*":  # "*/json" is no media range
        return None
    return MediaRange(kind, sub, _weight(params))


def _weight(params: list[str]) -> float:
    """The ``q`` among a range's parameters (the first; 1 if none): 0 unless a number from 0
    to 1. Other parameters (``level=1``, extensions) do not change what the range matches."""
    for param in params:
        key, _, val = param.partition("=")
        if key.strip().lower() == "q":
            try:
                q = float(val.strip())
            except ValueError:
                return 0.0
            return q if 0.0 <= q <= 1.0 else 0.0  # also NaN, which is never in range
    return 1.0


def quality(ranges: list[MediaRange], media: str) -> float:
    """How acceptable ``media`` (``type/subtype``) is: the ``q`` of the most specific range
    that matches it (``type/subtype``, then ``type/*``, then ``*/*``); 0 if none does, 1 if
    there are no ranges (no header: anything goes)."""
    if not ranges:
        return 1.0
    kind, _, sub = media.lower().partition("/")
    ladder = ((kind, sub), (kind, "*"), ("*", "*"))  # most specific first
    best, rank = 0.0, len(ladder)
    for r in ranges:  # highest q first: of equally specific ranges, the first counts
        at = ladder.index((r.type, r.subtype)) if (r.type, r.subtype) in ladder else rank
        if at < rank:
            best, rank = r.q, at
    return best


def named(ranges: list[MediaRange], media: str) -> float:
    """The ``q`` of the range that names ``media`` itself (the first, which has the highest
    ``q``); 0 if none does: a wildcard never names it."""
    kind, _, sub = media.lower().partition("/")
    return next((r.q for r in ranges if (r.type, r.subtype) == (kind, sub)), 0.0)


@functools.lru_cache(maxsize=256)  # clients send the same few headers again and again
def choose(accept: str | None, offers: tuple[str, ...], default: str) -> str:
    """The answer's media type: the one of ``offers`` that ``accept`` names with the highest
    ``q`` (the earlier of a tie), if that ``q`` is above 0 and at least ``default``'s;
    else ``default``."""
    if accept is None or accept.strip().lower() in _PLAIN:
        return default
    ranges = parse_accept(accept)
    best, best_q = default, 0.0
    for offer in offers:
        q = named(ranges, offer)
        if q > best_q:
            best, best_q = offer, q
    if best_q > 0.0 and best_q >= quality(ranges, default):
        return best
    return default
