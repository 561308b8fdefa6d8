"""The draft engine: keeps each sequence's tokens (and KV cache) and has its drafter propose after them.

A thin scheduler over the Drafter protocol (draft_service/drafters/base.py): it validates a call
(a ProposeCall, specdec/calls/request.py; its checks are specdec/calls/checks.py's), syncs the
sequence (rollback + catch-up, in the store), hands the drafter the call's target features, and
lets the drafter draft. Every drafter yields its proposals one token at a time, so the servicer
can stream each token the moment it exists. Which drafter to load is draft_service/loading.py's
business. No gRPC here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from draft_service.drafters.base import Drafter, Proposal
from draft_service.tree import TreeDraft
from specdec.errors import InvalidArgument
from specdec.forward.batching import forward_batch, pass_groups
from specdec.kv.store import Sequence, SequenceStore
from specdec.model.features import FeatureRows
from specdec.model.lm import feed
from specdec.serving.batcher import Requeue
from specdec.calls.checks import check_propose_call
from specdec.calls.request import ProposeCall

# Catch-up tokens an n-gram Propose may bring and still be answered on the event loop (answers_inline):
# a step's catch-up is the accepted tokens plus one (at most MAX_DRAFT_TOKENS + 1); a few hundred
# tokens index in well under a millisecond.
INLINE_APPEND = 256


class DraftEngine:
    """Not thread-safe: the servicer runs each step on one worker thread, or on the event loop
    while that worker has nothing to do (answers_inline)."""

    def __init__(self, drafter: Drafter, max_sequences: int = 256, idle_timeout_s: float = 600.0,
                 max_prefill_tokens: int = 0):
        """`max_prefill_tokens`: most pending tokens a row feeds in one batched pass (0: all), as the
        target's chunked prefill (forward_rows)."""
        self.drafter = drafter
        self.max_prefill_tokens = max_prefill_tokens
        self.store = SequenceStore(max_sequences, idle_timeout_s)

    def propose(self, call: ProposeCall) -> Iterator[Proposal]:
        """Syncs the sequence (rollback + catch-up), then yields the chain's proposals lazily.

        Validation and the sync happen eagerly, before the first token is asked for, so bad input
        fails the call at once. Drafted tokens are appended to the sequence's own token list; the
        next call's known_len crops the ones the target rejected.
        """
        start = time.perf_counter()
        if call.tree is not None:
            raise InvalidArgument("tree", "a chain's Propose takes no tree settings (ProposeTree)")
        seq = self.open(call)
        if call.draft_length == 0:
            return iter(())
        return self.drafter.propose(seq, call, start)

    def answers_inline(self, append: int) -> bool:
        """Whether a Propose is cheaper to answer on the event loop than to hand to the worker: an
        n-gram draft whose catch-up is short (indexing costs next to nothing a token). A thread
        hop each way cost more than the n-gram's whole draft: through the three services its
        exchange took several times its drafting, and markedly less answered inline.
        A prompt (or a lost sequence re-sent whole) still goes to the worker, so a 100k-token
        index build never stalls the other calls."""
        return self.drafter.inline and append <= INLINE_APPEND

    def batches(self, call: ProposeCall) -> bool:
        """Whether this chain can draft in forwards shared with other sequences (draft_service/
        batcher.py), through forward_rows and the drafter's begin/choose (Drafter.batches)."""
        return self.drafter.batches(call)

    def open(self, call: ProposeCall) -> Sequence:
        """Validates a Propose and syncs its sequence (rollback + catch-up, and for a feature draft
        the target features that came with it; other drafters ignore features)."""
        check_propose_call(call, self.drafter.vocab_size)
        seq = self.store.sync(call.sequence_id, call.known_len, call.append)
        self.drafter.receive(seq, call.features)
        return seq

    def forward_rows(self, seqs: list[Sequence]) -> list[torch.Tensor | Requeue]:
        """The next-token logits [V] of each sequence, feeding all their pending tokens in ONE pass.

        A sequence with more than max_prefill_tokens pending (a long prompt's catch-up) feeds that
        many this pass, one such row a pass, and comes back as Requeue: the batcher runs the other
        streams' steps before its next chunk (specdec/serving/batcher.py)."""
        lm = self.drafter.lm
        out: list[torch.Tensor | Requeue | None] = [None] * len(seqs)
        rows, budget = [], self.max_prefill_tokens
        for i, seq in enumerate(seqs):
            if self.max_prefill_tokens and seq.uncached > self.max_prefill_tokens:
                if budget:
                    feed(lm, seq, budget)
                    budget = 0
                out[i] = Requeue(seq)
            else:
                rows.append(i)
        self.drafter.forwards += len(rows)
        # rows of very unlike cache lengths in passes of their own (batching.PAD_KEYS)
        for group in ([rows[j] for j in group] for group in pass_groups(lm, [seqs[i].cached for i in rows])):
            if len(group) == 1:
                out[group[0]] = lm.forward(seqs[group[0]], keep=1)[0]  # alone: no batch buffer to gather and copy back
                continue
            logits, state = forward_batch(lm, [seqs[i] for i in group], [[] for _ in group], [1] * len(group))
            for row, i in enumerate(group):
                state.write_back(row, seqs[i], lm, len(seqs[i].tokens))
                out[i] = logits[row][0]
        return out

    def propose_tree(self, call: ProposeCall) -> TreeDraft:
        """Syncs the sequence, then drafts the tree `call.tree` asks for (draft_service/tree.py),
        at most call.draft_length deep. The sequence keeps only
        its canonical tokens afterwards: the next call's known_len is len(canonical) at this call.

        A drafter that cannot branch (n-gram, another vocabulary) sends its chain as a one-branch
        tree (drafters/base.py's chain_tree). A feature draft takes the call's features first, as
        for a chain.
        """
        start = time.perf_counter()
        if call.tree is None:
            raise InvalidArgument("tree", "a ProposeTree needs tree settings")
        seq = self.open(call)
        tree = self.drafter.propose_tree(seq, call, start)
        return dataclasses.replace(tree, compute_seconds=time.perf_counter() - start)

    def release(self, sequence_id: str) -> bool:
        return self.store.release(sequence_id)

    def warm_up(self) -> None:
        features = None
        if self.drafter.needs_features:  # without features a feature draft drafts nothing
            features = FeatureRows(0, torch.zeros(5, self.drafter.feature_dim))
        for _ in self.propose(ProposeCall("__warmup__", 0, [0, 1, 2, 3, 0, 1], 2, features=features)):
            pass
        self.store.release("__warmup__", retire=False)  # warm-ups may run again
