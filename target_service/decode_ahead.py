"""Decoding ahead: after its verdict, a row keeps decoding without an exchange (no gRPC here).

A Verify may ask the target to decode up to VerifyCall.decode_ahead more tokens alone, one forward
a pass, each pass verifying its own prompt-lookup draft if the row drafts by lookup. A lone row
decodes ahead by itself (`_decode_ahead`), the rows of a pass that holds every call together
(`_decode_ahead_rows`); both make a row's tokens alike (`_ahead_pass`, `_ahead_taken`). Apart from
the engine's verify path because it is a mechanism on top of it: TargetEngine (engine.py) takes
DecodeAhead's methods in, and they call back its `_verdict`, `_rows` and `_capturing`.
docs/architecture.md, "Decoding ahead", says why and what stays exact.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import torch

from specdec.errors import SpecdecError
from specdec.serving.batcher import Requeue
from specdec.kv.store import Sequence
from specdec.model.features import FeatureRows
from specdec.maths.lookup import NgramIndex, in_source, looked, lookup_draft
from specdec.calls.request import VerifyCall, VerifyResult
from specdec.maths.sampling import TokenLogprob


@dataclasses.dataclass
class _RowAhead:
    """A row decoding ahead after its pass's verdict, alone (TargetEngine._decode_ahead) or with the
    others of its pass (_decode_ahead_rows): both take their passes through _ahead_pass and
    _ahead_taken, so a row's tokens are made alike either way."""

    index: int  # the row's place among the pass's calls
    seq: Sequence
    call: VerifyCall  # the row's call without its catch-up and draft: a plain step at the next position
    lookup: NgramIndex | None  # its prompt-lookup index, when it drafts by lookup
    budget: int  # tokens it may decode
    most: int  # passes it may take
    pending: int  # its last token, not in the cache yet
    decoded: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    proposal: tuple | None = None  # this pass's lookup draft: (tokens, proposal, match length)
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    predicted: tuple[int, int] = (0, 0)  # of drafted and accepted, those from a predicted output
    ended: bool = False  # an end-of-sequence token was accepted inside a draft: what follows is cut anyway
    first: tuple[int, ...] = ()  # the tokens its call's own pass made canonical (draft tokens accepted, next token)
    sent: int = 0  # of first + decoded, how many went to TargetEngine.on_tokens
    settled: bool = False  # its result went to its caller while the other rows decode on (_decode_ahead_rows' settle)
    # A call that joined the pass (_joining): its own callback, call as sent, first pass's result and start
    answer: Callable[[VerifyResult | SpecdecError], None] | None = None
    origin: VerifyCall | None = None
    base: VerifyResult | None = None
    began: float = 0.0

    def unsent(self) -> tuple[str, int, list[int], list[TokenLogprob]]:
        """(sequence, index, tokens, their log-probabilities) made since the last report: `index`
        counts the call's tokens reported before these."""
        made = [*self.first, *self.decoded]
        start, self.sent = self.sent, len(made)
        return self.call.sequence_id, start, made[start:], self.logprobs[start:]

    def going(self, eos, context: int) -> bool:
        """Whether the row takes another pass: budget and passes left, no end of sequence, room in the context."""
        return (not self.ended and len(self.decoded) < self.budget and self.passes < self.most and self.pending not in eos
                and not (context and len(self.seq.tokens) + 2 > context))


class DecodeAhead:
    """Decoding ahead, as methods of TargetEngine: they read the engine's `lm`, `calibration`,
    `pass_costs` and `on_tokens`, and take their passes through its `_verdict` (a lone row) or `_rows` (a batch)."""

    # The most positions a call joining a pass decoding ahead may feed where prompts are not fed in
    # chunks (--max-prefill-tokens-per-pass 0; else a chunk's budget): a longer one would stretch a
    # forward every decoding row waits for, and waits for a pass of its own instead.
    JOIN_MOST = 64

    def _decode_ahead(self, call: VerifyCall, seq: Sequence, result: VerifyResult, start: float,
                      interrupt: Callable[[], bool] | None = None) -> VerifyResult:
        """Decodes up to call.decode_ahead more tokens after the verdict, one forward a pass.

        Why: the coordinator asks for this only for steps it would not draft anyway (an n-gram
        drafter resting after empty asks, speculation off), or whose draft the target can make
        itself (prompt lookup, call.lookup_draft_length), and each of those steps otherwise costs a
        whole exchange with the target, gRPC on top of the forward.
        Each pass verifies its lookup draft, if any, as a Verify at its position would (`_verdict`:
        greedy, or rejection sampling against a one-hot draft with the position-keyed generator),
        so greedy tokens are the ones those steps would have made and sampled ones follow the
        target's distribution. Stops after an end-of-sequence token, before the context is full,
        and once another call waits (`interrupt`: a new request then waits one pass, not eight);
        the coordinator cuts anything past its own stops.

        With return_features (a feature draft resting), each forward's hidden states extend the
        features, so they still cover every position the target holds: the draft catches up on
        the decoded tokens next time as it does on accepted ones.
        """
        row = self._ahead(call, seq, result)
        if row is None:
            return result
        eos, context = self.lm.eos_token_ids, self.lm.max_context
        rows = []
        self._report([row])
        while row.going(eos, context) and not (interrupt is not None and interrupt()):
            began = time.perf_counter()
            step = self._ahead_pass(row)
            with self._capturing(call.return_features) as hidden:
                logits = self.lm.forward(seq, step.draft_tokens, keep=len(step.draft_tokens) + 1)  # [1 + len(draft), V]
            taken, pending, chosen = self._verdict(step, logits, len(seq.tokens))
            if hidden:
                rows.append(hidden[0][0][: 1 + taken].float().cpu())  # the positions that are canonical now
            seq.tokens.extend(step.draft_tokens[:taken])
            seq.crop_cache(len(seq.tokens))
            self._ahead_taken(row, taken, pending, chosen)
            self.pass_costs.observe_lone(1 + len(step.draft_tokens), time.perf_counter() - began)
            self._report([row])
        features = result.features
        if rows and features is not None:
            features = FeatureRows(features.start, torch.cat([features.values, *rows]))
        return self._ahead_result(result, row, start, features=features)

    def _ahead(self, call: VerifyCall, seq: Sequence, result: VerifyResult, index: int = 0) -> _RowAhead | None:
        """The row that decodes ahead after `result`, or None if its budget is spent: a lookup draft's
        accepted tokens are among the caller's budget (_as_decoded), and end it at an end of sequence."""
        own = list(call.draft_tokens[:result.accepted]) if call.lookup_match else []
        budget = call.decode_ahead - len(own)
        if budget <= 0 or any(t in self.lm.eos_token_ids for t in own):
            return None
        plain = dataclasses.replace(call, append=[], draft_tokens=[], draft_dists=[], lookup_match=None)
        return _RowAhead(index, seq, plain, self._lookup_index(call, seq) if call.lookup_draft_length else None, budget,
                         call.decode_ahead_passes or budget, result.next_token, logprobs=list(result.logprobs),
                         first=(*call.draft_tokens[:result.accepted], result.next_token))

    def _report(self, rows: list[_RowAhead]) -> None:
        """Hands each row's tokens made since its last report to `on_tokens`, if set: a decoding run
        (target_service/runs.py) sends them out after every pass instead of after the call."""
        if self.on_tokens is not None:
            self.on_tokens([row.unsent() for row in rows])

    def _ahead_pass(self, row: _RowAhead, rows: int = 1, costs: dict | None = None) -> VerifyCall:
        """Makes the row's pending token canonical (its pass's first new position) and returns the call
        its pass verifies: a plain step, with the row's lookup draft when it drafts by lookup (where
        `rows` rows share the pass, not while its lookups rest: _looks). `costs`: the pass's lookup
        costs so far (_lookup_costs)."""
        row.seq.tokens.append(row.pending)
        row.proposal = ([], [], 0)
        if row.lookup is not None and self._looks(row.lookup, row.seq.tokens, rows):
            room = row.budget - len(row.decoded) - 1  # the pass's own token comes on top
            if self.lm.max_context:
                room = min(room, self.lm.max_context - len(row.seq.tokens) - 1)
            row.proposal = lookup_draft(row.lookup, self.calibration, row.call.lookup_draft_length,
                                        self._lookup_costs(row.call, rows, costs), room)
            if rows > 1:
                looked(row.lookup, len(row.proposal[0]))
        draft = row.proposal[0]
        return dataclasses.replace(row.call, draft_tokens=draft) if draft else row.call

    def _ahead_taken(self, row: _RowAhead, taken: int, next_token: int, logprobs) -> None:
        """Records a pass's verdict on the row: `taken` draft tokens accepted (already appended to the
        sequence), then `next_token`, pending."""
        draft, proposal, n = row.proposal
        if n:
            self.calibration.observe(n, proposal, draft[:taken] + [next_token], row.lookup.odds)
        row.decoded += draft[:taken] + [next_token]
        row.pending = next_token
        row.logprobs += logprobs
        row.passes, row.drafted, row.accepted = row.passes + 1, row.drafted + len(draft), row.accepted + taken
        if in_source(n):
            row.predicted = (row.predicted[0] + len(draft), row.predicted[1] + taken)
        row.ended = any(t in self.lm.eos_token_ids for t in draft[:taken])

    @staticmethod
    def _ahead_result(result: VerifyResult, row: _RowAhead, start: float, **extra) -> VerifyResult:
        compute = time.perf_counter() - start
        return dataclasses.replace(result, cached_len=len(row.seq.tokens), compute_seconds=compute,
                                   ahead_seconds=max(0.0, compute - result.compute_seconds), ahead_tokens=len(row.decoded),
                                   decoded=tuple(row.decoded), logprobs=tuple(row.logprobs), ahead_passes=row.passes,
                                   ahead_drafted=row.drafted, ahead_accepted=row.accepted,
                                   predicted_drafted=row.predicted[0], predicted_accepted=row.predicted[1], **extra)

    def _decode_ahead_rows(self, calls: list[VerifyCall], rows: list[tuple[int, Sequence]],
                           results: list[VerifyResult | SpecdecError | None], start: float,
                           interrupt: Callable[[], bool] | None, settle: Callable[[int, VerifyResult], None] | None = None,
                           dropped: Callable[[str], bool] | None = None, join=None) -> set[int]:
        """Decodes ahead for every row of a batched pass together: one batched forward a pass, as
        many passes as the row that asked least allows, each row's token (and lookup draft) made
        as `_decode_ahead` makes it alone. Writes the rows' results back into `results`.

        Why: under load the coordinators stop drafting, and every token of every sequence then costs
        an exchange of its own; between two passes the target waits for the last of them to come
        back (a sizeable share of a pass on a small machine). Decoding ahead, the passes follow one
        another with no exchange in between. Only when every row asked for it (a row that did not
        would wait for the others' passes) and all of them feed one forward; stopped as soon as a
        call is waiting (`interrupt`), so a request that arrives meanwhile waits one pass, not all.
        With `settle`, rows leave one by one instead: a row whose budget is spent, or whose caller is
        gone (`dropped`), gets its result through settle(index, result) at once and the others decode
        on for as many passes as the row that asked MOST allows. Why: under many streams a row
        finishes nearly every pass; ending every row's decoding there made every stream's caller
        submit again (an exchange a pass, on the event loop and the worker alike).
        With `join` too, the calls that arrive meanwhile join the pass before its next forward
        (`_joining`) and decode on with the others, instead of stopping it.
        Each row's tokens are the ones its own exchanges would have got, as exact as any batched
        pass: its verdict is keyed by position, and which rows share its forwards is the load's
        doing either way.
        """
        rows_ahead = self._rows_ahead(calls, rows, results)
        if not rows_ahead:
            return set()
        eos, context = self.lm.eos_token_ids, self.lm.max_context
        self._report(rows_ahead)
        passes = None if settle is not None else min(min(r.budget, r.most) for r in rows_ahead)
        joins, indices = (join if settle is not None else None), itertools.count(len(calls))
        fresh: list = []
        try:
            while passes is None or passes > 0:
                live = [r for r in rows_ahead if r.going(eos, context) and not (dropped is not None and dropped(r.call.sequence_id))]
                fresh = self._joining(joins, live, indices) if joins is not None else []
                if not (live or fresh) or (interrupt is not None and interrupt()):
                    for _, call, _, answer, _ in fresh:
                        answer(Requeue(call))
                    break  # the rows not settled yet are returned with the pass
                if settle is not None and len(live) < len(rows_ahead):
                    self._settle_rows(calls, rows_ahead, live, results, start, settle)
                passes = None if passes is None else passes - 1
                rows_ahead += self._ahead_forward(live, fresh, start)
                fresh = []  # rows now, or answered
        except BaseException as exc:
            for r in rows_ahead:  # the rows that joined have no place in the pass's results
                if r.answer is not None and not r.settled:
                    r.settled = True
                    r.answer(exc)
            for _, _, _, answer, _ in fresh:  # joined the failed forward: not rows yet
                answer(exc)
            raise
        for r in rows_ahead:
            if r.answer is not None and not r.settled:
                self._settle_rows(calls, [r], [], results, start, settle)
            elif not r.settled:
                results[r.index] = self._ahead_result(results[r.index], r, start)
        return {r.index for r in rows_ahead if r.settled and r.answer is None}

    def _rows_ahead(self, calls: list[VerifyCall], rows: list[tuple[int, Sequence]],
                    results: list[VerifyResult | SpecdecError | None]) -> list[_RowAhead]:
        """The pass's rows as rows decoding ahead, or none if any of them may not."""
        if len(rows) < 2 or len(rows) != len(calls):  # one row decodes ahead in _row; a chunk or an error: no
            return []
        rows_ahead: list[_RowAhead] = []
        for index, seq in rows:
            call, result = calls[index], results[index]
            if not isinstance(result, VerifyResult) or call.tree is not None or call.return_features or call.decode_ahead <= 0:
                return []
            row = self._ahead(call, seq, result, index)
            if row is None:
                return []
            rows_ahead.append(row)
        return rows_ahead

    def _ahead_forward(self, live: list[_RowAhead], fresh: list, start: float) -> list[_RowAhead]:
        """One forward of the live rows' next passes and the joined calls' own passes; returns the
        joined calls that decode on, as rows (those with nothing left to decode get their answer)."""
        costs: dict = {}
        steps = {r.index: self._ahead_pass(r, len(live) + len(fresh), costs) for r in live}
        steps.update((index, call) for index, call, _, _, _ in fresh)
        began = time.perf_counter()
        outcomes = self._rows(steps, [(r.index, r.seq) for r in live] + [(f[0], f[2]) for f in fresh], start, len(steps))
        # one forward of steps, as a batched pass's first forward is: under load every pass may
        # decode ahead, and these are then the only forwards the pass costs can learn from (not one
        # that fed a joined call's prompt, whose positions cost otherwise)
        if all(call.new_positions - len(call.draft_tokens) <= self.MIN_CHUNK for call in steps.values()):
            self.pass_costs.observe(sum(step.new_positions for step in steps.values()), time.perf_counter() - began)
        for r, outcome in zip(live, outcomes):
            self._ahead_taken(r, outcome.accepted, outcome.next_token, outcome.logprobs)
        self._report(live)
        joined = []
        for (index, call, seq, answer, began), outcome in zip(fresh, outcomes[len(live):]):
            outcome = dataclasses.replace(outcome, compute_seconds=time.perf_counter() - began)
            row = self._ahead(call, seq, outcome, index)
            if row is None:  # nothing to decode ahead: its own pass was all of it
                answer(self._as_decoded(call, outcome, seq) if call.lookup_match else outcome)
                continue
            row.answer, row.origin, row.base, row.began = answer, call, outcome, began
            self._report([row])
            joined.append(row)
        return joined

    def _joining(self, join, live: list[_RowAhead], indices) -> list[tuple[int, VerifyCall, Sequence, Callable, float]]:
        """The calls offered to the pass that join its next forward: (index, call, sequence, answer,
        when it joined) each, indices drawn from `indices`. A call joins if it names a sequence not in
        the pass, feeds no more than a pass's chunk (a prompt beside decoding rows), asks no tree and
        no features, and its sequence is held or has room (a new one must not evict a row's); the
        others wait for the next pass (Requeue), and a bad call gets its error."""
        held = {r.call.sequence_id for r in live}
        most = self.MIN_CHUNK
        # A prompt rides in the rows' forward where each row feeds its own positions (the compact
        # stack), but not while a longer prompt is fed in chunks: those are sized by what a chunk
        # adds to the rows' forward, which prompts riding in them would blur (a 4,000-token prompt
        # then went 2 tokens a pass: tests/test_loadtest.py, the victims' test).
        if self.ragged and not any(seq.uncached > self.MIN_CHUNK for seq in self.store):
            most = max(most, self._chunk_budget(alone=False) or self.JOIN_MOST)
        fresh = []
        for call, answer in join.take(len(live)):
            if (call.sequence_id in held or call.tree is not None or call.return_features
                    or call.prefill + len(call.append) > most
                    or (call.sequence_id not in self.store and len(self.store) >= self.store.max_sequences)):
                answer(Requeue(call))
                continue
            try:
                seq = self._prepare(call)
            except Exception as exc:  # noqa: BLE001 - a bad call (or a bug) fails that call, not the pass
                answer(exc)
                continue
            if call.lookup_draft_length and not call.draft_tokens:
                call = self._with_lookup(call, seq, len(live) + len(fresh) + 1)
            held.add(call.sequence_id)
            fresh.append((next(indices), call, seq, answer, time.perf_counter()))
        return fresh

    def _settle_rows(self, calls: list[VerifyCall], rows_ahead: list[_RowAhead], live: list[_RowAhead],
                     results: list, start: float, settle: Callable[[int, VerifyResult], None]) -> None:
        """Hands the rows that stopped decoding their results, as the pass would return them (a
        lookup draft's as the caller sees it: _as_decoded); a row that joined, through its own answer."""
        going = {id(r) for r in live}
        for r in rows_ahead:
            if r.settled or id(r) in going:
                continue
            r.settled = True
            if r.answer is not None:
                result = self._ahead_result(r.base, r, r.began)
                r.answer(self._as_decoded(r.origin, result, r.seq) if r.origin.lookup_match else result)
                continue
            result = self._ahead_result(results[r.index], r, start)
            call = calls[r.index]
            results[r.index] = self._as_decoded(call, result, r.seq) if call.lookup_match else result
            settle(r.index, results[r.index])
