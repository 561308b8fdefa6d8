"""Prefill planning: which rows of a pass feed a chunk of a long prompt, and how long a chunk is
(no gRPC here).

A prompt longer than a pass may feed (--max-prefill-tokens-per-pass) is fed in chunks over several
calls, so the other sequences' steps run between two chunks, or beside them in one forward where
the compact stack pads nothing (`_fuses`). A chunk's length follows measured costs (`_learn`,
`_chunk_budget`): long enough to drain a burst of prompts, short enough not to hold the decoding
sequences up. Apart from the engine's verify path because it is a policy over it: TargetEngine
(engine.py) takes PrefillPlanning's methods in; they read its `lm`, `store` and `max_prefill_tokens`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from specdec.errors import SpecdecError
from specdec.kv.store import Sequence
from specdec.model.cpu import stack
from specdec.serving.batcher import RECENT_FLOOR_S, RECENT_PASSES, Requeue
from specdec.calls.request import VerifyCall, VerifyResult


def _average(mean: float, sample: float) -> float:
    """A moving average that starts at its first sample (`mean` 0: none yet)."""
    return sample if not mean else 0.8 * mean + 0.2 * sample


class PrefillPlanning:
    """Chunked prefill, as methods of TargetEngine: the chunk of the pass, its length, and the
    measured costs that size it (`_step_s`, `_prefill_token_s`, `_forward_s`, `_chunk_token_s`,
    set in TargetEngine.__init__)."""

    def _split(self, calls: list[VerifyCall], prepared: list[tuple[int, Sequence]],
               results: list[VerifyResult | SpecdecError | None], decode_ahead: bool
               ) -> tuple[list[tuple[int, Sequence]], tuple[int, Sequence, int] | None]:
        """The rows whose tokens this pass verifies, and the one row (index, sequence, tokens) whose
        prompt is longer than a pass may feed and gets a chunk of it (`_chunk_budget`), the oldest.
        Another such row waits for a later pass (its Requeue goes into `results`): the budget is
        the pass's. A row drafting by lookup gets its draft here (into `calls`)."""
        rows: list[tuple[int, Sequence]] = []
        prompts: list[tuple[int, Sequence, int]] = []
        decoding = sum(1 for _, seq in prepared if seq.uncached <= self.MIN_CHUNK)  # rows whose steps share the pass
        costs: dict = {}  # the rows' lookup costs, by their callers' figures (_lookup_costs)
        for index, seq in prepared:
            call, pending = calls[index], seq.uncached
            if self.max_prefill_tokens and pending > self.MIN_CHUNK and not call.return_features:
                full = self._chunk_budget(alone=bool(decode_ahead) and not self._others_decode(seq))
                if pending > max(full, self.MIN_CHUNK):
                    prompts.append((index, seq, full))
                    continue
            if call.lookup_draft_length and not call.draft_tokens and call.tree is None:
                calls[index] = self._with_lookup(call, seq, decoding, costs)
            rows.append((index, seq))
        # The oldest prompt: the first in the pass was, but prompts arriving during a pass queue
        # ahead of those requeued after it, and each newcomer's chunks then went first while
        # older prompts waited (seconds, beside 8 streams of grounded prompts).
        chunk = min(prompts, key=lambda prompt: prompt[1].created, default=None)
        for index, seq, _ in prompts:
            if index != chunk[0]:
                results[index] = self._rest(calls[index], seq)
        return rows, chunk

    @functools.cached_property
    def ragged(self) -> bool:
        """Whether a pass's rows feed only their own positions (none padded to the longest row's):
        one forward of the compact stack (specdec/model/cpu/stack.py) takes them all so. Kept: the
        loader installs the stack before an engine exists, and the batcher asks every pass."""
        return stack.applies(self.lm)

    def pass_positions(self, call: VerifyCall) -> int:
        """The positions `call` feeds a pass (the batcher's cost): where a chunk rides in the rows'
        forward (`ragged`), a prompt longer than a chunk beside other rows feeds one chunk
        (`_chunk_budget`), not all of it. (Elsewhere a chunk takes a forward of its own, and a
        batch of prompts, each priced at a chunk, would be one chunk and many rows that wait.)"""
        canonical = call.prefill + len(call.append)
        if canonical <= self.MIN_CHUNK or not self.ragged:  # a step (its draft too): nothing to chunk
            return call.new_positions
        budget = self._chunk_budget(alone=False)
        # a prompt cut into chunks feeds one chunk and nothing of its draft, one fed whole all of it
        return max(budget, self.MIN_CHUNK) if budget and canonical > max(budget, self.MIN_CHUNK) else call.new_positions

    def _fuses(self, calls: list[VerifyCall], groups: list[list[tuple[int, Sequence]]]) -> bool:
        """Whether a prompt chunk rides in the rows' forward instead of one of its own: where the
        rows are one forward of the compact stack (specdec/model/cpu/stack.py), which pads nothing, so
        the chunk's positions cost only their own arithmetic and attention.

        Why: a forward's fixed cost (reading every weight once, and a hundred calls around the
        stack) is most of a decode step on a CPU, and a chunk in a forward of its own paid it again:
        beside decoding rows, chunks are cut short (`_chunk_budget`), so a prompt's many small chunks
        paid it many times (benchmarks/results/fused-chunks/NOTES.md). Exact all the
        same: the stack's rows do not depend on which rows share the pass."""
        return (len(groups) == 1 and self.ragged
                and all(calls[index].tree is None and not calls[index].return_features for index, _ in groups[0]))

    def _prompts_per_decoder(self) -> float:
        """Prompts still being fed per sequence that decodes (both counted as `_others_decode`
        counts), at least 1: how many CHUNK_STEPS a chunk beside decoding rows may take.

        Why: a chunk sized to the decoding rows' step alone made one decoding sequence hold six
        waiting prompts to a few tokens a pass (its own step is short, and on a CPU most of it is the
        pass's fixed cost). At 8 grounded streams the 700-800-token prompts waited more than twice
        as long for their first token as the 200-token ones, fed whole in the passes where nobody
        decoded (benchmarks/results/chunks-per-waiting-prompt/NOTES.md). Weighing the requests
        that wait for their first token against those waiting for their next one keeps the plain
        bound where prompts are few beside many streams (the victims' shape)."""
        horizon = self._recent()
        decoding = prompts = 0
        for seq in self.store:
            if seq.last_used >= horizon:
                if seq.uncached <= self.MIN_CHUNK:
                    decoding += 1
                else:
                    prompts += 1
        return max(1.0, prompts / max(1, decoding))

    def _recent(self) -> float:
        """The monotonic time after which a sequence's last call counts as lately: the batcher's
        horizon for its active sequences (RECENT_PASSES passes, at least RECENT_FLOOR_S)."""
        return time.monotonic() - max(RECENT_FLOOR_S, RECENT_PASSES * self._step_s)

    def _others_decode(self, seq: Sequence) -> bool:
        """Whether another sequence held here decodes: its prompt fed, and called lately (as the
        batcher counts its active ones). A long chunk would hold its steps up; long prompts that
        are all still being fed delay nobody's tokens by taking long chunks, and finish sooner.
        (A prompt that arrives meanwhile is the batcher's to see: its call waits, and the batcher
        says so.) This counted prompts with fewer than --max-prefill-tokens-per-pass tokens left
        as decoding, and sequences idle for long (a paused client, one gone without a release):
        120 prompts of 479 tokens beside one idle 3-token sequence then fed each other 2-token
        chunks and at times outlasted a shutdown's grace period (tests/test_shutdown.py). "Fed"
        allows the token or two a step's call brings: the rows of this very pass hold them, and a
        chunk riding in their forward (_fuses) must not take them for prompts."""
        horizon = self._recent()
        return any(other is not seq and other.uncached <= self.MIN_CHUNK and other.last_used >= horizon for other in self.store)

    # A chunk may take this share of a step of the other sequences, per prompt being fed per sequence
    # decoding (_prompts_per_decoder, at least one): their time per token grows by that much (plus
    # the long sequence's own steps once it decodes) while a long prompt is fed.
    # Sizes follow the measured time per chunk token (fixed costs included), so a chunk converges to
    # the size that takes this share. Less keeps the others' steps shorter; but where a chunk's
    # fixed costs dominate (small models), shorter chunks mostly add passes, and a burst of long
    # prompts drains slowly (benchmarks/results/chunked-prefill/NOTES.md, "Long prompts without victims").
    CHUNK_STEPS = 0.75
    MIN_CHUNK = 2  # tokens: at thousands of keys one token's attention is a sizeable share of a step
    # The longest a lone long prompt's chunk may take: a short request arriving meanwhile waits for
    # it, and 8x chunks deep into a long prompt take seconds on a small CPU.
    ALONE_CHUNK_S = 0.5

    def _chunk_budget(self, alone: bool) -> int:
        """Canonical tokens one row may feed in this pass: --max-prefill-tokens-per-pass, less where
        the measured costs say a chunk that long would hold the other sequences' steps up for more
        than CHUNK_STEPS of their steps, times the prompts being fed per decoding sequence (on a CPU
        a few dozen prompt tokens cost as much as a step);
        a row that delays nobody's decoding (`alone`: _others_decode) feeds 8 times as much, within
        ALONE_CHUNK_S: a request that arrives meanwhile waits for that chunk before its first step."""
        limit = self.max_prefill_tokens
        if not limit:
            return 0
        if alone:
            if self._prefill_token_s:
                return max(limit, min(limit * 8, int(self.ALONE_CHUNK_S / self._prefill_token_s)))
            return limit * 8
        share = self.CHUNK_STEPS * self._prompts_per_decoder()
        if self.ragged and self._forward_s and self._chunk_token_s:  # riding in the rows' forward (_fuses)
            return max(self.MIN_CHUNK, min(limit, int(share * self._forward_s / self._chunk_token_s)))
        if self._step_s and self._prefill_token_s:
            return max(self.MIN_CHUNK, min(limit, int(share * self._step_s / self._prefill_token_s)))
        return limit

    def _learn(self, step_s: float = 0.0, prefill_token_s: float = 0.0, forward_s: float = 0.0, chunk_token_s: float = 0.0) -> None:
        """Moving averages (chunk sizing) of a verify pass's time and of a prompt token's in a chunk's
        own forward; and of one forward of decode steps, and of what a chunk's token adds to such a
        forward when it rides in it (_fuses).

        Why two measures of a step: a pass's time counts a prompt fed whole beside the rows and a
        lone row's passes decoded ahead, which a chunk riding in one forward of steps must not be
        sized by (a 4,000-token prompt's last piece, fed whole beside two rows, took as long as
        many steps and pulled the average pass up so far that chunks sized from it would run at
        the 256-token limit).
        Chunks in forwards of their own keep the pass's time, on which they were tuned: sized by a
        step's own time, where a chunk forward's fixed cost is most of a step (the tiny test
        models), they shrank to 2 tokens and 120 queued prompts no longer drained within the
        shutdown test's grace period (tests/test_shutdown.py)."""
        if step_s:
            self._step_s = _average(self._step_s, step_s)
        if forward_s:
            self._forward_s = _average(self._forward_s, forward_s)
        if prefill_token_s:
            self._prefill_token_s = _average(self._prefill_token_s, prefill_token_s)
        if chunk_token_s:
            self._chunk_token_s = _average(self._chunk_token_s, chunk_token_s)

    @staticmethod
    def _rest(call: VerifyCall, seq: Sequence) -> Requeue:
        """The call that goes on after a chunk of a row's prompt was fed (or none yet), without a
        verdict.

        Why chunks: a prefill is one forward over every pending position, compute-bound, and every
        other sequence's next step waits for it (a prompt of thousands of tokens held a CPU for many
        seconds). In chunks, the other sequences' rows run between two chunks, or beside them in
        one forward (specdec/serving/batcher.py, Requeue; `_fuses`). The rest call names every token
        the target now holds (known_len), so its sync keeps the cache; `prefill` tells the batcher
        how many positions it still feeds. A call asking for the target's hidden states (a feature
        draft) is fed whole: its features must cover every position it feeds.
        """
        return Requeue(dataclasses.replace(call, known_len=len(seq.tokens), append=[], prefill=seq.uncached))
