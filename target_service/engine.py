"""The target engine: scores a proposal in one forward pass and verifies it. No gRPC here.

A step feeds the tokens the target has not seen (the prompt on the first call, then the previous
step's correction or bonus token) followed by the g draft tokens, all in ONE forward pass, and keeps
the logits of the last g+1 positions: position i predicts the token after draft token i-1.

Each idea on top of the verify path has a module of its own, whose methods TargetEngine takes in:
decoding ahead (decode_ahead.py), the target's own prompt-lookup drafts and what a position costs a
pass (lookup.py), prefill planning: chunks of long prompts (prefill.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable

import structlog
import torch

from specdec.errors import InvalidArgument, SpecdecError
from specdec.model.features import FeatureRows
from specdec.kv.store import Sequence, SequenceStore
from specdec.model.interface import LanguageModel, sequence_bound
from specdec.model.lm import feed, pending_only
from specdec.maths.sampling import (SamplingConfig, TokenLogprob, ban_tokens, chosen_logprobs, generator_for, target_probs,
                                   token_logprobs)
from specdec.forward.tree import forward_tree, keep_positions, supports_trees
from specdec.forward.batching import batchable, forward_batch, pass_groups
from specdec.calls.checks import check_verify_call
from specdec.maths.costs import knee_of_passes
from specdec.maths.lookup import LOOKUP_MAX_N, MatchCalibration
from specdec.calls.request import VerifyCall, VerifyResult
from specdec.maths.tree import EMPTY_DIST, SparseDist, tree_depth
from specdec.maths.treeplan import TreePlan, plan_tree, tree_verdict
from specdec.serving.batcher import Requeue
from specdec.maths.verify import verify_greedy_row, verify_greedy_rows, verify_rejection
from target_service.decode_ahead import DecodeAhead
from target_service.lookup import PassCosts, TargetLookup
from target_service.prefill import PrefillPlanning

log = structlog.get_logger(__name__)


class TargetEngine(PrefillPlanning, TargetLookup, DecodeAhead):
    """Not thread-safe: the servicer runs every call on one worker thread, in arrival order."""

    def __init__(self, lm: LanguageModel, max_sequences: int = 256, idle_timeout_s: float = 600.0, max_prefill_tokens: int = 0):
        """`max_prefill_tokens`: most canonical tokens a row feeds in one verify_batch call (0: all);
        a longer prompt is fed in chunks over several calls (chunked prefill, `_chunk`)."""
        self.lm = lm
        self.max_prefill_tokens = max_prefill_tokens
        self._step_s = self._prefill_token_s = 0.0  # measured costs that size the chunks (_chunk_budget)
        self._forward_s = self._chunk_token_s = 0.0  # the same, for a chunk riding in the rows' forward (_fuses)
        self.pass_costs = PassCosts()  # what a position adds to a forward: cuts lookup drafts in batched passes
        # a static GPU cache (specdec/model/gpu/static.py) holds a fixed number of sequences: evict past it
        self.store = SequenceStore(sequence_bound(max_sequences, lm), idle_timeout_s)
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

    def _capturing(self, wanted: bool):
        """The final hidden states of the forwards inside, when a call asked for them."""
        return self.lm.capturing_features() if wanted else contextlib.nullcontext([])

    @staticmethod
    def _features(seq: Sequence, before: int, hidden: torch.Tensor) -> FeatureRows:
        """Rows of a forward's positions [before, ...) that are canonical now: the appended tokens
        and the accepted draft tokens (hidden [T, H] covers the whole forward)."""
        return FeatureRows(before, hidden[: len(seq.tokens) - before].float().cpu())

    @staticmethod
    def _tree_features(before: int, length: int, path: list[int], hidden: torch.Tensor) -> FeatureRows:
        """Rows of a tree pass's positions that are canonical now: the appended tokens [before,
        length) and the accepted path's nodes (hidden [T, H]: the appended rows, then the nodes in
        the pass's order)."""
        pending = length - before
        rows = torch.cat([torch.arange(pending), pending + torch.tensor(path, dtype=torch.long)])
        return FeatureRows(before, hidden[rows.to(hidden.device)].float().cpu())

    def verify_batch(self, calls: list[VerifyCall], decode_ahead: bool = True,
                     interrupt: Callable[[], bool] | None = None, settle: Callable[[int, VerifyResult], None] | None = None,
                     dropped: Callable[[str], bool] | None = None, join=None) -> list[VerifyResult | SpecdecError]:
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
        together (`_decode_ahead_rows`), until `interrupt()` says a call is waiting; a row whose
        caller is gone (`dropped(sequence_id)`) stops on its own. `settle(index, result)`: rows of
        a pass decoding ahead may finish apart, each handed its result as it finishes (on this thread).
        `join` (specdec/serving/batcher.py, Joins; with `settle`): calls that arrive meanwhile join
        the rows decoding ahead between two forwards (`_joining`), answered through their own callback.
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
                results[index] = self._row(calls[index], seq, start, len(rows), decode_ahead and len(rows) == 1,
                                           _or_dropped(interrupt, dropped, calls[index].sequence_id))
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
        settled = set()  # rows answered already, as the caller sees them
        if decode_ahead and len(groups) == 1:  # the rows' passes are one forward each
            settled = self._decode_ahead_rows(calls, rows, results, start, interrupt, settle, dropped, join)
        for index, seq in rows:
            if calls[index].lookup_match and isinstance(results[index], VerifyResult) and index not in settled:
                results[index] = self._as_decoded(calls[index], results[index], seq)
        return results

    def _groups(self, rows: list[tuple[int, Sequence]]) -> list[list[tuple[int, Sequence]]]:
        """The rows of each forward of a pass."""
        if not self.batchable:  # a model whose cache cannot be padded: row by row
            return [[row] for row in rows]
        # rows of very unlike cache lengths in passes of their own (batching.PAD_KEYS)
        return [[rows[i] for i in group] for group in pass_groups(self.lm, [seq.cached for _, seq in rows])]

    def _row(self, call: VerifyCall, seq: Sequence, start: float, batch_size: int, decode_ahead: bool,
             interrupt: Callable[[], bool] | None = None) -> VerifyResult:
        """One row's forward on its own; it decodes ahead only when it is the pass's only row
        (decoding ahead would hold the other rows up for several forwards)."""
        if call.tree is not None:
            return self._tree_row(call, seq, start, batch_size)
        before, began = seq.cached, time.perf_counter()
        positions = len(seq.tokens) - before + len(call.draft_tokens)
        with self._capturing(call.return_features) as hidden:
            logits = self.lm.forward(seq, call.draft_tokens, keep=len(call.draft_tokens) + 1)
        result = self._finish(call, seq, logits, start, batch_size, hidden[0][0] if hidden else None, before)
        seq.crop_cache(len(seq.tokens))
        if before:  # a step's pass (a prompt's first, which attends to nothing cached, is not one)
            self.pass_costs.observe_lone(positions, time.perf_counter() - began)
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
            logits, state = forward_batch(self.lm, seqs, extras, keeps, trees, on_device=True)
        if feeding is not None:
            state.write_back(len(rows), fed, self.lm, fed_to)
        verdicts = self._greedy_verdicts(calls, rows, plans, logits)
        results = []
        for row, ((index, seq), plan) in enumerate(zip(rows, plans)):
            if row not in verdicts:  # sampled, logprobs, trees: their maths reads the logits on the CPU
                logits[row] = logits[row].cpu()
            if plan is not None:
                length = len(seq.tokens)  # the canonical tokens, before the accepted path joins them
                result, path = self._finish_tree(calls[index], seq, plan, logits[row], start, batch_size)
                if calls[index].return_features and hidden:
                    result = dataclasses.replace(result, features=self._tree_features(befores[row], length, path, hidden[0][row]))
                state.write_back(row, seq, self.lm, length, [length + node for node in path])
            else:
                result = self._finish(calls[index], seq, logits[row], start, batch_size,
                                      hidden[0][row] if hidden else None, befores[row], verdicts.get(row))
                state.write_back(row, seq, self.lm, len(seq.tokens))  # only the accepted positions
            results.append(result)
        return results

    def _greedy_verdicts(self, calls: list[VerifyCall], rows: list[tuple[int, Sequence]], plans: list[TreePlan | None],
                         logits: list[torch.Tensor]) -> dict[int, tuple[int, int]]:
        """{row: (accepted, next token)} for the pass's greedy chain rows that ask no logprobs, in one
        argmax over all of them (verify_greedy_rows): on a GPU only their token ids reach the host.
        A row under a min_tokens ban gets its banned logits first (ban_tokens), as _verdict does."""
        chosen, these, drafts = [], [], []
        for row, ((index, seq), plan) in enumerate(zip(rows, plans)):
            call = calls[index]
            if plan is None and call.sampling.greedy and call.logprobs is None:
                chosen.append(row)
                these.append(ban_tokens(logits[row], len(seq.tokens), call.eos_banned_until, self.lm.eos_token_ids))
                drafts.append(call.draft_tokens)
        return dict(zip(chosen, verify_greedy_rows(these, drafts)))

    def verify_tree(self, call: VerifyCall) -> VerifyResult:
        """Verifies a draft tree in ONE forward pass (tree attention, positions by depth) and keeps
        only the accepted path in the cache, as if that path had been fed as a chain.

        A model whose cache cannot be gathered by position (sliding-window layers) verifies the
        chain of first children instead (specdec/maths/treeplan.py).
        """
        start = time.perf_counter()
        return self._tree_row(call, self._prepare(call), start, 1)

    def _tree_row(self, call: VerifyCall, seq: Sequence, start: float, batch_size: int) -> VerifyResult:
        plan = self._plan(call)
        before, length = seq.cached, len(seq.tokens)  # length: the canonical tokens, before the accepted path joins them
        with self._capturing(call.return_features) as hidden:
            if not self.trees:  # the chain of first children, fed as a chain (sliding windows stay intact)
                logits = self.lm.forward(seq, plan.tokens, keep=len(plan.tokens) + 1)
            else:
                logits = forward_tree(self.lm, seq, plan.tokens, plan.parents)  # [N+1, V]
        result, path = self._finish_tree(call, seq, plan, logits, start, batch_size)
        if call.return_features and hidden:  # a feature draft's next ask needs the accepted path's features
            result = dataclasses.replace(result, features=self._tree_features(before, length, path, hidden[0][0]))
        if not self.trees:
            seq.crop_cache(len(seq.tokens))
        else:
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
                hidden: torch.Tensor | None = None, before: int = 0, verdict: tuple[int, int] | None = None) -> VerifyResult:
        """The verdict (or the greedy one already reached for the whole pass); appends the accepted
        tokens. hidden [T, H]: the row's final hidden states."""
        if verdict is not None:
            (accepted, next_token), logprobs = verdict, []
        else:
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

    KNEE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # positions of the passes pass_knee times

    def pass_knee(self, repeats: int = 3) -> int:
        """The most positions one pass verifies before it costs 1.5 times a one-position pass
        (costs.knee_of_passes), from chains of KNEE_SIZES positions timed here after a 32-token
        context (the median of `repeats` after one untimed): what ModelInfo.verify_knee reports and
        coordinators share among their running requests by default (--verify-token-budget).

        Why timed at start-up on the device in use: the curve is the device's own (a compact CPU
        kernel's steep, a GPU's flat until compute binds), and one constant measured on a 2-core
        CPU zeroed every draft at 8 streams on an H100, where the positions cost nothing."""
        vocab = self.lm.vocab_size
        context = [3 + i % (vocab - 3) for i in range(32)]
        room = (self.lm.max_context or 1 << 30) - len(context) - 1
        seq = self.store.sync("__knee__", 0, context)
        try:
            self.lm.forward(seq, [], keep=1)
            seconds = {}
            for n in (n for n in self.KNEE_SIZES if n <= room):
                extra = [3 + (7 * i) % (vocab - 3) for i in range(n - 1)]
                times = []
                for _ in range(repeats + 1):
                    seq.tokens = [*context, 5]
                    began = time.perf_counter()
                    self.lm.forward(seq, extra, keep=n)  # its logits reach the host: the pass is over
                    times.append(time.perf_counter() - began)
                    seq.crop_cache(len(context))
                seconds[n] = statistics.median(times[1:])
        finally:
            seq.tokens = list(context)
            self.store.release("__knee__", retire=False)
        return knee_of_passes(seconds) if 1 in seconds else 0  # a context too short to time in: not measured

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



def _or_dropped(interrupt: Callable[[], bool] | None, dropped: Callable[[str], bool] | None,
                sequence_id: str) -> Callable[[], bool] | None:
    """A lone row's interrupt: another call waits, or its own caller is gone."""
    if dropped is None:
        return interrupt
    return lambda: (interrupt is not None and interrupt()) or dropped(sequence_id)
