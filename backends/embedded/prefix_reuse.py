"""Reusing the keys and values of a prompt's prefix that another request computed.

The members of a GRPO group send one prompt several times, and an agent's next turn sends the
whole conversation again: without reuse every one of them is prefilled from the first token.
Here a request admitted to a slot looks for a source whose cache holds the longest prefix of
its tokens, and its slot's cache takes those positions by a copy instead of a forward:

- an active request (another member of the group, usually), whose computed tokens are the
  prefix; one still being prefilled is waited for (the follower skips steps until the
  source's cache covers the prefix), so members that arrive together prefill once;
- a free slot that still holds what its last request computed (the previous turn of an
  agent's conversation, until the slot is taken).

Only keys and values of the current weights are reused: a weight update starts a new epoch,
and caches of older epochs are never sources. At least one token is always left to feed,
since its logits give the first sampled token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

# A shorter shared prefix is fed again: a follower would wait a step for little.
MIN_REUSE_TOKENS = 16
# Sources looked at per admission, newest first: a group's members arrive together, and the
# scan stays cheap beside a GPU step however many requests are active.
MAX_CANDIDATES = 64


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of the common prefix of ``a`` and ``b``, at most ``limit`` (binary search
    over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b), limit)
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Reuse:
    """The best source found: ``length`` tokens from free slot ``slot`` or from ``source``
    (an active request)."""

    length: int
    slot: int | None = None
    source: object | None = None


class HeldPrefixes:
    """The computed tokens each free slot's cache still holds, of the current epoch."""

    def __init__(self) -> None:
        self._held: dict[int, list[int]] = {}

    def keep(self, slot: int, tokens: list[int]) -> None:
        if len(tokens) >= MIN_REUSE_TOKENS:
            self._held[slot] = tokens
        else:
            self._held.pop(slot, None)

    def drop(self, slot: int) -> None:
        self._held.pop(slot, None)

    def clear(self) -> None:
        self._held.clear()

    def items(self) -> Iterable[tuple[int, list[int]]]:
        return reversed(list(self._held.items())[-MAX_CANDIDATES:])


def best_source(
    tokens: list[int],
    held: HeldPrefixes,
    active: Iterable[tuple[object, list[int]]],
) -> Reuse | None:
    """The source holding the longest prefix of ``tokens`` (all but the last), if at least
    ``MIN_REUSE_TOKENS`` long: a free slot's held tokens or an active request's tokens."""
    limit = len(tokens) - 1
    if limit < MIN_REUSE_TOKENS:
        return None
    head = tokens[:MIN_REUSE_TOKENS]
    best: Reuse | None = None
    for slot, source, have in _candidates(held, active):
        if have[:MIN_REUSE_TOKENS] != head:
            continue
        n = common_prefix(tokens, have, limit)
        if best is None or n > best.length:
            best = Reuse(n, slot=slot, source=source)
            if n == limit:
                break
    return best if best is not None and best.length >= MIN_REUSE_TOKENS else None


def _candidates(
    held: HeldPrefixes, active: Iterable[tuple[object, list[int]]]
) -> Iterator[tuple[int | None, object | None, list[int]]]:
    """(free slot, or active request, and the tokens it holds), free slots first."""
    for slot, have in held.items():
        yield slot, None, have
    for source, have in itertools.islice(active, MAX_CANDIDATES):
        yield None, source, have
