"""Per-sequence state with rollback: the tokens a service holds and the KV cache over them.

The cache is soft state (docs/architecture.md, "State"). Every call names `known_len`, the canonical prefix the
caller builds on; `SequenceStore.sync` crops what the service holds beyond it (the rejected draft
tokens), appends the caller's new tokens, and raises SequenceNotFound when the service holds less
than the caller believes (a restart, an eviction, another replica), so the caller re-sends it all.

Invariant: `seq.cached <= len(seq.tokens) - 1` after a sync, so the next forward always feeds at
least the last token and yields the logits that predict what follows it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
import dataclasses
import time
from typing import Any

import structlog

from specdec.errors import InvalidArgument, Overloaded, SequenceNotFound, SequenceReleased

log = structlog.get_logger(__name__)

# Ids are echoed in error messages, and gRPC drops a reply whose status message passes 16 KiB.
MAX_SEQUENCE_ID = 256


def check_sequence_id(sequence_id: str) -> None:
    if not 0 < len(sequence_id) <= MAX_SEQUENCE_ID:
        raise InvalidArgument("sequence_id", f"must have 1 to {MAX_SEQUENCE_ID} characters, got {len(sequence_id)}")


@dataclasses.dataclass
class Sequence:
    """One sequence's tokens, and the KV cache over its first `cached` tokens."""

    sequence_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    cache: Any = None  # a transformers Cache, or None for drafters without a model
    cached: int = 0  # leading positions of `tokens` (plus fed drafts) whose keys/values are in `cache`
    side: Any = None  # a drafter's own per-sequence state beside the cache (staged drafting's n-gram index)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    created: float = dataclasses.field(default_factory=time.monotonic)  # first come, first fed (prompt chunks)

    @property
    def uncached(self) -> int:
        """Tokens held but not in the cache yet: what the next forward feeds before any draft."""
        return len(self.tokens) - self.cached

    def crop_cache(self, length: int) -> None:
        """Drops cached positions past `length` (rollback). Cropping is O(1) views in transformers."""
        if length <= 0:
            self.cache = None  # a fresh cache is cheaper and simpler than cropping to nothing
        elif self.cache is not None and self.cached > length:
            self.cache.crop(length - self.cached)  # negative: drop that many trailing positions
        self.cached = min(self.cached, length)


def crop_to(cache, length: int) -> None:
    """Keeps a transformers cache's first `length` positions, whatever it holds now (transformers'
    crop takes the number to drop, negated; Sequence.crop_cache trusts `cached`, this does not)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class SequenceStore:
    """The sequences a service holds, least recently used first, with a capacity.

    Past `max_sequences`, the least recently used idle sequence is evicted: memory stays bounded and
    the coordinator re-fills an evicted sequence from its canonical tokens if it comes back.
    """

    # Released ids remembered so a late call cannot re-create them; bounded, oldest forgotten first.
    RETIRED_IDS = 65536

    def __init__(self, max_sequences: int, idle_timeout_s: float = 0.0):
        self.max_sequences = max_sequences
        self.idle_timeout_s = idle_timeout_s
        self._sequences: collections.OrderedDict[str, Sequence] = collections.OrderedDict()
        # Calls for one sequence travel as separate RPCs, so a Propose or Verify the coordinator
        # cancelled can reach the engine after its Release; without this it would re-create the
        # sequence and hold its cache until the idle timeout.
        self._retired: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Called once per sequence created (a prefill, or a re-fill after a loss): the services count
        # them, so a fleet shows which replica served which sequences and whether any was re-filled.
        self.on_start: Callable[[], object] = lambda: None
        # Called with the number of sequences held after every change (a start, a release, an
        # eviction, an idle expiry): the services' gauges follow it, so they fall back to 0 when
        # the last sequence goes, not only when the next call happens to look.
        self.on_change: Callable[[int], object] = lambda held: None

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._sequences

    def __iter__(self):
        """The sequences held, least recently used first (a snapshot: safe to release while iterating)."""
        return iter(list(self._sequences.values()))

    def sync(self, sequence_id: str, known_len: int, append: list[int]) -> Sequence:
        """Rolls the sequence back to `known_len` canonical tokens and appends `append`."""
        check_sequence_id(sequence_id)
        if known_len < 0:
            raise InvalidArgument("known_len", f"must be >= 0, got {known_len}")
        if known_len == 0 and not append:
            raise InvalidArgument("append_tokens", "a sequence sent from the start (known_len=0) needs at least one token")
        self.expire_idle()
        seq = self._sequences.get(sequence_id)
        if known_len == 0:
            if seq is None and sequence_id in self._retired:
                raise SequenceReleased(sequence_id)
            seq = self._create(sequence_id) if seq is None else seq
            seq.tokens = []
            seq.crop_cache(0)
        elif seq is None:
            raise SequenceNotFound(sequence_id, "is not held here (never created, released or evicted)")
        elif len(seq.tokens) < known_len:
            raise SequenceNotFound(sequence_id, f"holds {len(seq.tokens)} tokens, fewer than known_len={known_len}")
        del seq.tokens[known_len:]
        seq.tokens.extend(append)
        seq.crop_cache(min(known_len, len(seq.tokens) - 1))
        seq.last_used = time.monotonic()
        self._sequences.move_to_end(sequence_id)
        return seq

    def release(self, sequence_id: str, retire: bool = True) -> bool:
        """Frees the sequence and retires its id (even if unseen: its first call may still be in flight)."""
        check_sequence_id(sequence_id)
        if retire:
            self._retired[sequence_id] = None
            self._retired.move_to_end(sequence_id)
            while len(self._retired) > self.RETIRED_IDS:
                self._retired.popitem(last=False)
        released = self._sequences.pop(sequence_id, None) is not None
        if released:
            self.on_change(len(self._sequences))
        return released

    def _create(self, sequence_id: str) -> Sequence:
        if len(self._sequences) >= self.max_sequences:
            if not self._sequences:
                raise Overloaded("this service holds no sequences (max_sequences=0)")
            evicted, _ = self._sequences.popitem(last=False)
            log.warning("evicted least recently used sequence", evicted=evicted, capacity=self.max_sequences)
        seq = Sequence(sequence_id)
        self._sequences[sequence_id] = seq
        log.info("sequence started", sequence_id=sequence_id)
        self.on_start()
        self.on_change(len(self._sequences))
        return seq

    def expire_idle(self) -> int:
        """Frees sequences a vanished coordinator left behind; returns how many. Every sync runs it,
        and the services also run it on a timer (specdec/serving/engine_host.py, `expire_idle_sequences`),
        since after the last coordinator is gone no sync comes to run it."""
        if self.idle_timeout_s <= 0:
            return 0
        deadline = time.monotonic() - self.idle_timeout_s
        expired = 0
        while self._sequences:
            oldest_id, oldest = next(iter(self._sequences.items()))
            if oldest.last_used >= deadline:
                break
            del self._sequences[oldest_id]
            expired += 1
            log.info("expired idle sequence", sequence_id=oldest_id, idle_timeout_s=self.idle_timeout_s)
        if expired:
            self.on_change(len(self._sequences))
        return expired
