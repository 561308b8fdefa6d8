"""The target engine: scores a proposal in one forward pass and verifies it. No gRPC here.

A step feeds the tokens the target has not seen (the prompt on the first call, then the previous
step's correction or bonus token) followed by the g draft tokens, all in ONE forward pass, and keeps
the logits of the last g+1 positions: position i predicts the token after draft token i-1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import structlog
import torch

from specdec.errors import InvalidArgument, SpecdecError
from specdec.model.features import FeatureRows
from specdec.kv.store import Sequence, SequenceStore
from specdec.model import stack
from specdec.model.lm import CausalLM, feed, pending_only
from specdec.spec.sampling import (SamplingConfig, TokenLogprob, ban_tokens, chosen_logprobs, generator_for, target_probs,
                                   token_logprobs)
from specdec.forward.tree import forward_tree, keep_positions, supports_trees
from specdec.forward.batching import batchable, forward_batch, pass_groups
from specdec.limits import MAX_DRAFT_TOKENS
from specdec.spec.checks import check_verify_call
from specdec.spec.lookup import LOOKUP_MAX_N, MatchCalibration, NgramIndex, in_source, lookup_draft
from specdec.spec.request import VerifyCall, VerifyResult
from specdec.spec.tree import EMPTY_DIST, SparseDist, tree_depth
from specdec.spec.treeplan import TreePlan, plan_tree, tree_verdict
from specdec.serving.batcher import RECENT_FLOOR_S, RECENT_PASSES, Requeue
from specdec.spec.verify import verify_greedy_row, verify_rejection

log = structlog.get_logger(__name__)


def _average(mean: float, sample: float) -> float:
    """A moving average that starts at its first sample (`mean` 0: none yet)."""
    return sample if not mean else 0.8 * mean + 0.2 * sample



class PassCosts:
    """Seconds of one forward against the positions it feeds, a + b * positions, fitted by least
    squares over recent forwards (each reading weighs `decay` times less per later one).

    Why: where a pass holds several rows, a drafted position costs what it adds to the pass
    (`b`), which the rows' share of the pass must pay back; a coordinator's V(n) / V(1), timed on
    its own requests' steps, cannot tell that cost apart, since the other rows set a batched pass's
    time. On a CPU a drafted position adds a sizeable part of a row's share of a batched pass (at
    8 rows on 2 cores, a first draft token had to be right ~40% of the time to pay:
    benchmarks/results/lookup-by-pass-costs/NOTES.md); on a GPU `b` is near 0 until compute binds.
    `lookup_costs(rows, most)` is V(1 + g) / V(1) as seen from one row's share, in the form
    VerifyCall.lookup_costs carries."""

    MIN_READINGS = 8.0  # no estimate before this many (decayed) readings, nor without spread

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._sums = [0.0] * 5  # weight, x, y, xx, xy

    def observe(self, positions: int, seconds: float) -> None:
        d, x, y = self.decay, float(positions), seconds
        w, sx, sy, sxx, sxy = self._sums
        self._sums = [w * d + 1, sx * d + x, sy * d + y, sxx * d + x * x, sxy * d + x * y]

    def line(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds a position, or None while the readings cannot say."""
        w, sx, sy, sxx, sxy = self._sums
        if w < self.MIN_READINGS:
            return None
        var = sxx / w - (sx / w) ** 2
        if var < 1.0:  # all forwards fed (nearly) as many positions: no slope to read
            return None
        b = max(0.0, (sxy / w - sx / w * sy / w) / var)
        a = sy / w - b * sx / w
        return (a, b) if a > 0 else None

    def lookup_costs(self, rows: int, most: int) -> tuple[float, ...]:
        """Relative costs of 1..most+1 positions for one of `rows` rows (() for one row: its
        caller's costs hold). Before the readings say, a position costs a whole share (nothing
        drafted pays): a full batch on a CPU comes near that, and the first passes measure it."""
        if rows < 2:
            return ()
        line = self.line()
        if line is None:
            return tuple(1.0 + g for g in range(most + 1))
        a, b = line
        share = (a + b * rows) / rows
        return tuple(1.0 + g * b / share for g in range(most + 1))


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


class TargetEngine:
    """Not thread-safe: the servicer runs every call on one worker thread, in arrival order."""

    def __init__(self, lm: CausalLM, max_sequences: int = 256, idle_timeout_s: float = 600.0, max_prefill_tokens: int = 0):
        """`max_prefill_tokens`: most canonical tokens a row feeds in one verify_batch call (0: all);
        a longer prompt is fed in chunks over several calls (chunked prefill, `_chunk`)."""
        self.lm = lm
        self.max_prefill_tokens = max_prefill_tokens
        self._step_s = self._prefill_token_s = 0.0  # measured costs that size the chunks (_chunk_budget)
        self._forward_s = self._chunk_token_s = 0.0  # the same, for a chunk riding in the rows' forward (_fuses)
        self.pass_costs = PassCosts()  # what a position adds to a forward: cuts lookup drafts in batched passes
        # a static GPU cache (specdec/model/static.py) holds a fixed number of sequences: evict past it
        self.store = SequenceStore(min(max_sequences, getattr(lm, "max_sequences", max_sequences)), idle_timeout_s)
        self.batchable = batchable(lm)
        self.trees = supports_trees(lm)
        # The chance that each token of a prompt-lookup draft is right, per match length, learned from
        # this engine's own verdicts: the target's lookup drafts are cut by it (VerifyCall.lookup_draft_length).
        # Matches in a predicted output (lookup_source) count as n + LOOKUP_MAX_N: learned apart.
        self.calibration = MatchCalibration(2 * LOOKUP_MAX_N)
        # Called on the worker after each pass decoded ahead with [(sequence, index, tokens, logprobs)]
        # (_RowAhead.unsent): whoever streams tokens as they come (target_service/runs.py) sets it.
        self.on_tokens: Callable[[list[tuple[str, int, list[int], list[TokenLogprob]]]], None] | None = None

    def verify(self, call: VerifyCall) -> VerifyResult:
        """One sequence's chain: verify_batch's one-row path, with its error raised."""
        result = self.verify_batch([call])[0]
        while isinstance(result, Requeue):  # a long prompt, fed a chunk a call
            result = self.verify_batch([result.call])[0]
        if isinstance(result, SpecdecError):
            raise result
        return result

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
            step = self._ahead_pass(row)
            with self._capturing(call.return_features) as hidden:
                logits = self.lm.forward(seq, step.draft_tokens, keep=len(step.draft_tokens) + 1)  # [1 + len(draft), V]
            taken, pending, chosen = self._verdict(step, logits, len(seq.tokens))
            if hidden:
                rows.append(hidden[0][0][: 1 + taken].float().cpu())  # the positions that are canonical now
            seq.tokens.extend(step.draft_tokens[:taken])
            seq.crop_cache(len(seq.tokens))
            self._ahead_taken(row, taken, pending, chosen)
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

    def _ahead_pass(self, row: _RowAhead, rows: int = 1) -> VerifyCall:
        """Makes the row's pending token canonical (its pass's first new position) and returns the call
        its pass verifies: a plain step, with the row's lookup draft when it drafts by lookup."""
        row.seq.tokens.append(row.pending)
        row.proposal = ([], [], 0)
        if row.lookup is not None:
            row.lookup.extend(row.seq.tokens[len(row.lookup):])
            room = row.budget - len(row.decoded) - 1  # the pass's own token comes on top
            if self.lm.max_context:
                room = min(room, self.lm.max_context - len(row.seq.tokens) - 1)
            row.proposal = lookup_draft(row.lookup, self.calibration, row.call.lookup_draft_length,
                                        self._lookup_costs(row.call, rows), room)
        draft = row.proposal[0]
        return dataclasses.replace(row.call, draft_tokens=draft) if draft else row.call

    def _ahead_taken(self, row: _RowAhead, taken: int, next_token: int, logprobs) -> None:
        """Records a pass's verdict on the row: `taken` draft tokens accepted (already appended to the
        sequence), then `next_token`, pending."""
        draft, proposal, n = row.proposal
        if n:
            self.calibration.observe(n, proposal, draft[:taken] + [next_token])
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

    @staticmethod
    def _lookup_index(call: VerifyCall, seq: Sequence) -> NgramIndex:
        """The sequence's prompt-lookup index, kept beside its cache across calls (Sequence.side).

        The index keeps the tokens it shares with the sequence and indexes only the rest: a step
        indexes the tokens that arrived since the last one, not the whole sequence, and a call's
        passes decoded ahead reuse what its own pass indexed. Shared, not merely held by both: a
        call without lookup may have rolled the sequence back and re-grown it in between (then the
        tokens below call.known_len are still shared), and a stale n-gram would draft worse tokens,
        never wrong ones. A call that brings a source (a predicted output: the call that creates the
        sequence, or re-fills it) starts an index over it, which later calls keep."""
        index = seq.side if isinstance(seq.side, NgramIndex) else None
        if index is None or (call.lookup_source and tuple(call.lookup_source) != index.source):
            index = NgramIndex(LOOKUP_MAX_N, 1, call.lookup_source)
        keep = min(len(index), len(seq.tokens))
        if index.tokens[:keep] != seq.tokens[:keep]:
            keep = min(keep, call.known_len)
            if index.tokens[:keep] != seq.tokens[:keep]:
                index, keep = NgramIndex(LOOKUP_MAX_N, 1, index.source), 0
        index.crop(keep - len(index))
        seq.side = index
        return index

    def _capturing(self, wanted: bool):
        """The final hidden states of the forwards inside, when a call asked for them."""
        return self.lm.capturing_features() if wanted else contextlib.nullcontext([])

    @staticmethod
    def _features(seq: Sequence, before: int, hidden: torch.Tensor) -> FeatureRows:
        """Rows of a forward's positions [before, ...) that are canonical now: the appended tokens
        and the accepted draft tokens (hidden [T, H] covers the whole forward)."""
        return FeatureRows(before, hidden[: len(seq.tokens) - before].float().cpu())

    def verify_batch(self, calls: list[VerifyCall], decode_ahead: bool = True,
                     interrupt: Callable[[], bool] | None = None) -> list[VerifyResult | SpecdecError]:
        """Verifies several sequences' proposals in ONE forward pass (specdec/forward/batching.py),
        or a few where the rows' cache lengths differ so much that padding them to the longest
        would cost more than another pass (pad_groups).

        Each row fails on its own: a row with a bad field or a lost sequence gets its error back
        and the others go ahead. Rows must name distinct sequences (the batcher sees to it). The
        tokens each row gets are the ones `verify` would give it alone: same per-row logits up to
        float rounding, same per-row verdict, same per-position seeded uniforms when sampling.
        Rows decode ahead (VerifyCall.decode_ahead) only if `decode_ahead`: the batcher says no
        while sequences outside the pass are active, whose calls it would hold up. A lone row
        decodes ahead on its own (`_decode_ahead`), the rows of a pass that holds every call
        together (`_decode_ahead_rows`), until `interrupt()` says a call is waiting.
        """
        start = time.perf_counter()
        calls = list(calls)  # a row that drafts by lookup gets its draft here
        results: list[VerifyResult | SpecdecError | None] = [None] * len(calls)
        rows: list[tuple[int, Sequence]] = []
        prepared: list[tuple[int, Sequence]] = []
        for index, call in enumerate(calls):
            try:
                prepared.append((index, self._prepare(call)))
            except SpecdecError as exc:
                results[index] = exc
        rows, chunk = self._split(calls, prepared, results, decode_ahead)
        groups = self._groups(rows)
        fused = chunk is not None and self._fuses(calls, groups)
        # a pass whose rows are steps (not a prompt fed whole) measures a step, or what a chunk adds to one
        steps = all(seq.uncached <= self.MIN_CHUNK for _, seq in rows)
        if chunk is not None and not fused:  # the chunk in a forward of its own, before the rows'
            index, seq, budget = chunk
            feed(self.lm, seq, budget)
            results[index] = self._rest(calls[index], seq)
            self._learn(prefill_token_s=(time.perf_counter() - start) / budget)
            start = time.perf_counter()
        for group in groups:
            if len(group) == 1 and not fused:
                (index, seq), = group
                results[index] = self._row(calls[index], seq, start, len(rows), decode_ahead and len(rows) == 1, interrupt)
                continue
            for (index, _), result in zip(group, self._rows(calls, group, start, len(rows), chunk if fused else None)):
                results[index] = result
        # a lone row's passes decoded ahead (_row) are not one forward: one of them is
        ahead = sum(r.ahead_passes for r in results if isinstance(r, VerifyResult))
        if fused:
            index, seq, budget = chunk
            results[index] = self._rest(calls[index], seq)
            if self._forward_s and steps:  # what the chunk added to the rows' forward, a token
                self._learn(chunk_token_s=max(time.perf_counter() - start - self._forward_s, 0.0) / budget)
        elif rows:
            elapsed = time.perf_counter() - start
            self._learn(step_s=elapsed, forward_s=elapsed / (1 + ahead) if steps else 0.0)
        if steps and rows and len(groups) == 1 and not ahead:
            # one forward of steps: what its positions cost (a chunk riding in it counts with them;
            # a prompt fed whole, whose positions attend to hundreds of keys each, does not)
            positions = sum(calls[index].new_positions for index, _ in rows) + (chunk[2] if fused else 0)
            self.pass_costs.observe(positions, time.perf_counter() - start)
        if decode_ahead and len(groups) == 1:  # the rows' passes are one forward each
            self._decode_ahead_rows(calls, rows, results, start, interrupt)
        for index, _ in rows:
            if calls[index].lookup_match and isinstance(results[index], VerifyResult):
                results[index] = self._as_decoded(calls[index], results[index])
        return results

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
        for index, seq in prepared:
            call, pending = calls[index], seq.uncached
            if self.max_prefill_tokens and pending > self.MIN_CHUNK and not call.return_features:
                full = self._chunk_budget(alone=bool(decode_ahead) and not self._others_decode(seq))
                if pending > max(full, self.MIN_CHUNK):
                    prompts.append((index, seq, full))
                    continue
            if call.lookup_draft_length and not call.draft_tokens and call.tree is None:
                calls[index] = self._with_lookup(call, seq, decoding)
            rows.append((index, seq))
        # The oldest prompt: the first in the pass was, but prompts arriving during a pass queue
        # ahead of those requeued after it, and each newcomer's chunks then went first while
        # older prompts waited (seconds, beside 8 streams of grounded prompts).
        chunk = min(prompts, key=lambda prompt: prompt[1].created, default=None)
        for index, seq, _ in prompts:
            if index != chunk[0]:
                results[index] = self._rest(calls[index], seq)
        return rows, chunk

    @property
    def ragged(self) -> bool:
        """Whether a pass's rows feed only their own positions (none padded to the longest row's):
        one forward of the compact stack (specdec/model/stack.py) takes them all so."""
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
        rows are one forward of the compact stack (specdec/model/stack.py), which pads nothing, so
        the chunk's positions cost only their own arithmetic and attention.

        Why: a forward's fixed cost (reading every weight once, and a hundred calls around the
        stack) is most of a decode step on a CPU, and a chunk in a forward of its own paid it again:
        beside decoding rows, chunks are cut short (`_chunk_budget`), so a prompt's many small chunks
        paid it many times (benchmarks/results/fused-chunks/NOTES.md). Exact all the
        same: the stack's rows do not depend on which rows share the pass."""
        return (len(groups) == 1 and self.ragged
                and all(calls[index].tree is None and not calls[index].return_features for index, _ in groups[0]))

    def _groups(self, rows: list[tuple[int, Sequence]]) -> list[list[tuple[int, Sequence]]]:
        """The rows of each forward of a pass."""
        if not self.batchable:  # a model whose cache cannot be padded: row by row
            return [[row] for row in rows]
        # rows of very unlike cache lengths in passes of their own (batching.PAD_KEYS)
        return [[rows[i] for i in group] for group in pass_groups(self.lm, [seq.cached for _, seq in rows])]

    def _decode_ahead_rows(self, calls: list[VerifyCall], rows: list[tuple[int, Sequence]],
                           results: list[VerifyResult | SpecdecError | None], start: float,
                           interrupt: Callable[[], bool] | None) -> None:
        """Decodes ahead for every row of a batched pass together: one batched forward a pass, as
        many passes as the row that asked least allows, each row's token (and lookup draft) made
        as `_decode_ahead` makes it alone. Writes the rows' results back into `results`.

        Why: under load the coordinators stop drafting, and every token of every sequence then costs
        an exchange of its own; between two passes the target waits for the last of them to come
        back (a sizeable share of a pass on a small machine). Decoding ahead, the passes follow one
        another with no exchange in between. Only when every row asked for it (a row that did not
        would wait for the others' passes) and all of them feed one forward; stopped as soon as a
        call is waiting (`interrupt`), so a request that arrives meanwhile waits one pass, not all.
        Each row's tokens are the ones its own exchanges would have got, as exact as any batched
        pass: its verdict is keyed by position, and which rows share its forwards is the load's
        doing either way.
        """
        if len(rows) < 2 or len(rows) != len(calls):  # one row decodes ahead in _row; a chunk or an error: no
            return
        rows_ahead: list[_RowAhead] = []
        for index, seq in rows:
            call, result = calls[index], results[index]
            if not isinstance(result, VerifyResult) or call.tree is not None or call.return_features or call.decode_ahead <= 0:
                return
            row = self._ahead(call, seq, result, index)
            if row is None:
                return
            rows_ahead.append(row)
        eos, context = self.lm.eos_token_ids, self.lm.max_context
        self._report(rows_ahead)
        for _ in range(min(min(r.budget, r.most) for r in rows_ahead)):
            live = [r for r in rows_ahead if r.going(eos, context)]
            if not live or (interrupt is not None and interrupt()):
                break
            steps = {r.index: self._ahead_pass(r, len(live)) for r in live}
            for r, outcome in zip(live, self._rows(steps, [(r.index, r.seq) for r in live], start, len(live))):
                self._ahead_taken(r, outcome.accepted, outcome.next_token, outcome.logprobs)
            self._report(live)
        for r in rows_ahead:
            results[r.index] = self._ahead_result(results[r.index], r, start)

    def _lookup_costs(self, call: VerifyCall, rows: int) -> tuple[float, ...]:
        """The relative costs that cut a row's lookup draft: the caller's V(n) / V(1) (its own
        requests' steps), or where `rows` rows share the pass and it costs more, what each drafted
        position adds to the pass against the row's share of it (PassCosts). None asked (a fixed
        draft length): none given."""
        mine = call.lookup_costs
        if not mine or rows < 2:
            return mine
        return tuple(max(c, s) for c, s in zip(mine, self.pass_costs.lookup_costs(rows, len(mine) - 1)))

    def _with_lookup(self, call: VerifyCall, seq: Sequence, rows: int = 1) -> VerifyCall:
        """`call` with the draft prompt lookup makes for its pass (maybe none), among `rows` rows."""
        index = self._lookup_index(call, seq)
        index.extend(seq.tokens[len(index):])
        room = MAX_DRAFT_TOKENS
        if self.lm.max_context:
            room = min(room, self.lm.max_context - len(seq.tokens))
        draft, proposal, n = lookup_draft(index, self.calibration, call.lookup_draft_length, self._lookup_costs(call, rows), room)
        return dataclasses.replace(call, draft_tokens=draft, draft_dists=[], lookup_match=(n, tuple(proposal))) if n else call

    def _as_decoded(self, call: VerifyCall, result: VerifyResult) -> VerifyResult:
        """A result whose draft was the target's own, as the caller sees it: the caller knows no
        draft tokens, so the accepted ones come first among the tokens made canonical (next_token,
        then decoded), and count with the lookup drafts of the passes decoded ahead."""
        n, proposal = call.lookup_match
        self.calibration.observe(n, list(proposal), [*call.draft_tokens[:result.accepted], result.next_token])
        tokens = [*call.draft_tokens[:result.accepted], result.next_token, *result.decoded]
        predicted = (len(call.draft_tokens), result.accepted) if in_source(n) else (0, 0)
        return dataclasses.replace(result, accepted=0, next_token=tokens[0], decoded=tuple(tokens[1:]),
                                   ahead_drafted=result.ahead_drafted + len(call.draft_tokens),
                                   ahead_accepted=result.ahead_accepted + result.accepted,
                                   predicted_drafted=result.predicted_drafted + predicted[0],
                                   predicted_accepted=result.predicted_accepted + predicted[1])

    def _row(self, call: VerifyCall, seq: Sequence, start: float, batch_size: int, decode_ahead: bool,
             interrupt: Callable[[], bool] | None = None) -> VerifyResult:
        """One row's forward on its own; it decodes ahead only when it is the pass's only row
        (decoding ahead would hold the other rows up for several forwards)."""
        if call.tree is not None:
            return self._tree_row(call, seq, start, batch_size)
        before = seq.cached
        with self._capturing(call.return_features) as hidden:
            logits = self.lm.forward(seq, call.draft_tokens, keep=len(call.draft_tokens) + 1)
        result = self._finish(call, seq, logits, start, batch_size, hidden[0][0] if hidden else None, before)
        seq.crop_cache(len(seq.tokens))
        return self._decode_ahead(call, seq, result, start, interrupt) if decode_ahead else result

    def _rows(self, calls: list[VerifyCall], rows: list[tuple[int, Sequence]], start: float, batch_size: int,
              feeding: tuple[int, Sequence, int] | None = None) -> list[VerifyResult]:
        """Several rows (chains and trees mixed) in ONE batched forward; their results in order.
        `feeding` (index, sequence, tokens): a prompt chunk fed in the same forward (`_fuses`)."""
        seqs = [seq for _, seq in rows]
        plans = [self._plan(calls[index]) if calls[index].tree is not None else None for index, _ in rows]
        extras = [plan.tokens if plan else calls[index].draft_tokens for plan, (index, _) in zip(plans, rows)]
        keeps = [len(extra) + 1 for extra in extras]
        trees = [plan.parents if plan else None for plan in plans]
        befores = [seq.cached for seq in seqs]
        chunk = contextlib.nullcontext()
        if feeding is not None:  # one more row: its next tokens only, no logits kept
            _, fed, count = feeding
            chunk, fed_to = pending_only(fed, count), fed.cached + count
            seqs, extras, keeps, trees = [*seqs, fed], [*extras, []], [*keeps, 0], [*trees, None]
        with self._capturing(any(calls[index].return_features for index, _ in rows)) as hidden, chunk:
            logits, state = forward_batch(self.lm, seqs, extras, keeps, trees)
        if feeding is not None:
            state.write_back(len(rows), fed, self.lm, fed_to)
        results = []
        for row, ((index, seq), plan) in enumerate(zip(rows, plans)):
            if plan is not None:
                length = len(seq.tokens)  # the canonical tokens, before the accepted path joins them
                result, path = self._finish_tree(calls[index], seq, plan, logits[row], start, batch_size)
                state.write_back(row, seq, self.lm, length, [length + node for node in path])
            else:
                result = self._finish(calls[index], seq, logits[row], start, batch_size,
                                      hidden[0][row] if hidden else None, befores[row])
                state.write_back(row, seq, self.lm, len(seq.tokens))  # only the accepted positions
            results.append(result)
        return results

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

    def verify_tree(self, call: VerifyCall) -> VerifyResult:
        """Verifies a draft tree in ONE forward pass (tree attention, positions by depth) and keeps
        only the accepted path in the cache, as if that path had been fed as a chain.

        A model whose cache cannot be gathered by position (sliding-window layers) verifies the
        chain of first children instead (specdec/spec/treeplan.py).
        """
        start = time.perf_counter()
        return self._tree_row(call, self._prepare(call), start, 1)

    def _tree_row(self, call: VerifyCall, seq: Sequence, start: float, batch_size: int) -> VerifyResult:
        plan = self._plan(call)
        if not self.trees:  # the chain of first children, fed as a chain (sliding windows stay intact)
            logits = self.lm.forward(seq, plan.tokens, keep=len(plan.tokens) + 1)
            result, _ = self._finish_tree(call, seq, plan, logits, start, batch_size)
            seq.crop_cache(len(seq.tokens))
            return result
        length = len(seq.tokens)  # the canonical tokens, before the accepted path joins them
        logits = forward_tree(self.lm, seq, plan.tokens, plan.parents)  # [N+1, V]
        result, path = self._finish_tree(call, seq, plan, logits, start, batch_size)
        keep_positions(seq, length, [length + node for node in path])
        return result

    def _plan(self, call: VerifyCall) -> TreePlan:
        return plan_tree(call.tree, call.sampling, self.lm.vocab_size, self.trees)

    def _finish_tree(self, call: VerifyCall, seq: Sequence, plan: TreePlan, logits: torch.Tensor, start: float,
                     batch_size: int) -> tuple[VerifyResult, list[int]]:
        """The verdict; appends the accepted tokens. Returns the result and the accepted plan nodes
        (the caller trims the cache to the canonical tokens + those nodes)."""
        path, next_token = tree_verdict(plan, call.sampling, logits, len(seq.tokens))
        seq.tokens.extend(plan.tokens[i] for i in path)
        caller_path = tuple(plan.nodes[i] for i in path)
        return VerifyResult(len(path), next_token, len(seq.tokens), time.perf_counter() - start, path=caller_path,
                            batch_size=batch_size), path

    def _prepare(self, call: VerifyCall) -> Sequence:
        check_verify_call(call, self.lm.vocab_size, self.lm.has_features)
        seq = self.store.sync(call.sequence_id, call.known_len, call.append)
        if call.lookup_source:  # kept for the lookup drafts of this call and the later ones (_lookup_index)
            self._lookup_index(call, seq)
        total = len(seq.tokens) + (tree_depth(call.tree.parents) if call.tree is not None else len(call.draft_tokens))
        if self.lm.max_context and total > self.lm.max_context:
            raise InvalidArgument("draft_tokens", f"sequence would hold {total} tokens, past the target's context of {self.lm.max_context}")
        return seq

    def _finish(self, call: VerifyCall, seq: Sequence, logits: torch.Tensor, start: float, batch_size: int,
                hidden: torch.Tensor | None = None, before: int = 0) -> VerifyResult:
        """The verdict; appends the accepted tokens. hidden [T, H]: the row's final hidden states."""
        accepted, next_token, logprobs = self._verdict(call, logits, len(seq.tokens))
        seq.tokens.extend(call.draft_tokens[:accepted])
        features = self._features(seq, before, hidden) if call.return_features and hidden is not None else None
        return VerifyResult(accepted, next_token, len(seq.tokens), time.perf_counter() - start, features=features,
                            logprobs=tuple(logprobs), batch_size=batch_size)

    def _verdict(self, call: VerifyCall, logits: torch.Tensor, position: int) -> tuple[int, int, list[TokenLogprob]]:
        """(accepted, next token, their log-probabilities if asked) of one row; logits [G+1, V];
        `position` is the first draft token's index (row i scores position + i)."""
        logits = ban_tokens(logits, position, call.eos_banned_until, self.lm.eos_token_ids)
        gamma = len(call.draft_tokens)
        if call.sampling.greedy:
            accepted, next_token = verify_greedy_row(logits, call.draft_tokens)
        else:
            q = target_probs(logits, call.sampling)  # [G+1, V]
            p = self._dense_draft_probs(call.draft_tokens, call.draft_dists, q.shape[-1])  # [G, V]
            # Keyed by position, not by call order: a row draws the same uniforms in any batch.
            gen = generator_for(call.sampling.seed, position, "target")
            accept_u, sample_u = torch.rand(1, gamma, generator=gen), torch.rand(1, generator=gen)
            drafts = torch.tensor([call.draft_tokens], dtype=torch.long)  # [1, G]
            verdict = verify_rejection(q[None], drafts, p[None], torch.tensor([gamma]), accept_u, sample_u)
            accepted, next_token = int(verdict.accepted[0]), int(verdict.next_tokens[0])
        if call.logprobs is None:
            return accepted, next_token, []
        chosen = call.draft_tokens[:accepted] + [next_token]
        return accepted, next_token, token_logprobs(chosen_logprobs(logits[: len(chosen)], call.sampling), chosen, call.logprobs)

    def release(self, sequence_id: str) -> bool:
        return self.store.release(sequence_id)

    def warm_up(self) -> None:
        """One prefill and one verification so the first real request pays no lazy initialisation."""
        self.verify(VerifyCall("__warmup__", 0, [0, 1, 2, 3], [4, 5], [], SamplingConfig()))
        self.store.release("__warmup__", retire=False)  # warm-ups may run again
        ids, greedy = ("__warmup__", "__warmup2__"), SamplingConfig()
        first = self.verify_batch([VerifyCall(ids[0], 0, [0, 1, 2, 3], [4, 5], [], greedy), VerifyCall(ids[1], 0, [0, 1], [4], [], greedy)])
        # and once more with caches to pad: the batched path's two shapes
        self.verify_batch([VerifyCall(i, r.cached_len, [r.next_token], [4], [], greedy) for i, r in zip(ids, first)])
        for sequence_id in ids:
            self.store.release(sequence_id, retire=False)

    @staticmethod
    def _dense_draft_probs(tokens: list[int], dists: list[SparseDist], vocab: int) -> torch.Tensor:
        """[G, V] draft probabilities; a token sent without a distribution was drawn with p = 1 (one-hot)."""
        p = torch.zeros(len(tokens), vocab)
        for i, token in enumerate(tokens):
            ids, probs = dists[i] if dists else EMPTY_DIST
            if ids:
                p[i, torch.tensor(ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float32)
            else:
                p[i, token] = 1.0
        return p

