"""What the speculative loop (coordinator/loop.py) exchanges with the services and its callers.

The proposer and verifier are protocols: gRPC clients (coordinator/clients.py) in production,
in-process engines (coordinator/local.py) in benchmarks and tests, so the same loop runs with or
without the network. The outcomes they return, a request as the loop runs it (GenerationSpec) and
what a run reports (Stats) are plain data, here so that every module of the coordinator can name
them without importing the loop; a Propose's call, a Verify's call and its result are the engines'
own types (specdec/calls/request.py), which the loop passes as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

from specdec.calls.request import ProposeCall, TreeSettings, VerifyCall, VerifyResult
from specdec.maths.sampling import SamplingConfig, TokenLogprob
from specdec.maths.tree import SparseDist, tree_depth


@dataclasses.dataclass(frozen=True)
class DraftOutcome:
    tokens: list[int]
    dists: list[SparseDist]  # chains: per token; trees: per position (root, then nodes), the children's p (EMPTY_DIST: one-hot)
    compute_seconds: float
    wall_seconds: float
    wire_bytes: int = 0
    parents: list[int] | None = None  # a tree: node i continues parents[i] (-1: the last canonical token)
    confidence: list[float] | None = None  # chains: the draft's cumulative probability at each token

    @property
    def depth(self) -> int:
        """Draft positions the longest branch spans (a chain's length)."""
        return len(self.tokens) if self.parents is None else tree_depth(self.parents)


@dataclasses.dataclass
class Progress:
    """A Propose in flight, as far as it got: a run-ahead's first token (its bonus guess) decides
    whether the rest is worth waiting for, and the count says how much work a cancelled one did."""

    first: asyncio.Future
    tokens: int = 0

    def arrived(self, token: int) -> None:
        if self.tokens == 0 and not self.first.done():
            self.first.set_result(token)
        self.tokens += 1


class Proposer(Protocol):
    async def propose(self, call: ProposeCall, progress: Progress | None = None) -> DraftOutcome:
        """A chain, or a tree (call.tree): the one request type the draft engine takes too.
        `progress`, if given, is kept up to date as a chain's tokens arrive (see Progress)."""
        ...

    async def release(self, sequence_id: str) -> None: ...


class Verifier(Protocol):
    async def verify(self, call: VerifyCall) -> VerifyResult:
        """A chain, or a tree (call.tree): the one request type the target engine takes too."""
        ...

    async def release(self, sequence_id: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """A sequence the target decodes alone until it ends (target_service/runs.py): its prompt lookup
    drafts, or none, need no draft service, so no exchange separates its passes."""

    sequence_id: str
    append: list[int]  # the canonical tokens (a run starts a fresh sequence: known_len 0)
    sampling: SamplingConfig
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    eos_banned_until: int = 0
    logprobs: int | None = None
    lookup_draft_length: int = 0  # as VerifyCall's
    lookup_costs: tuple[float, ...] = ()
    lookup_source: tuple[int, ...] = ()
    draft_length: int = 0  # draft with the target's own draft service, up to this many tokens a step
    adaptive: bool = True  # ... adapting the length as this loop would
    seeded: bool = False  # ... with static lengths (the client chose the seed)
    features: bool = False  # ... a feature draft: the target sends it its hidden states
    overlap: bool = False  # ... pipelined: the draft drafts the next step during this one's pass
    report_every: int = 1  # the target sends the run's tokens in bursts of this many (--stream-interval)


@dataclasses.dataclass(frozen=True)
class DecodeProgress:
    """What a run made since its last progress, and what it cost; `done` on its last."""

    tokens: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    predicted_drafted: int = 0  # of drafted, tokens from the run's predicted output (lookup_source)
    predicted_accepted: int = 0  # of which it accepted
    compute_seconds: float = 0.0
    done: bool = False
    wire_bytes: int = 0  # this progress's bytes on the wire (the first one's include the run's start)


class Decoder(Protocol):
    retry_s: float  # how long a run is started again while the target is away (a restart)

    def decode(self, run: DecodeRun) -> AsyncIterator[DecodeProgress]:
        """The run's progress as the target makes it, through its `done` one. Raises
        SequenceNotFound where the target lost the sequence (it restarted, the stream broke): the
        caller starts the run again from its canonical tokens, under another sequence id. Closing
        the iterator early stops the run."""
        ...


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """A validated request, in target token ids."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    draft_length: int
    adaptive: bool
    eos_token_ids: frozenset[int]
    seeded: bool = False  # the client chose the seed: keep the run reproducible (specdec/maths/draft_length.py)
    max_context: int = 0  # 0: unbounded
    tree: TreeSettings | None = None  # draft trees instead of chains (the draft length caps their depth)
    logprobs: int | None = None  # report the target's log-probabilities, with this many alternatives (chains only)
    min_tokens: int = 0  # no end-of-sequence token among the first min_tokens (the target bans them: chains only)
    prediction_ids: tuple[int, ...] = ()  # a predicted output: the target's prompt lookup drafts from it too
    # The client gets the tokens only when the request ends (a unary Generate or a non-streamed HTTP
    # completion, without stop strings): a burst of tokens then delays nobody, so the target decodes
    # ahead as far as the request allows, from the prompt's exchange on, rather than a first token
    # alone and then --decode-ahead passes an exchange.
    answered_whole: bool = False


@dataclasses.dataclass
class Stats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    draft_tokens: int = 0
    draft_steps: int = 0  # steps that verified at least one draft token
    load_capped_steps: int = 0  # steps that drafted nothing because the load cap (--verify-token-budget) left no room
    prediction_tokens: int = 0  # draft tokens taken from the request's prediction (among draft_tokens)
    accepted_prediction_tokens: int = 0  # of which the target accepted (among accepted_tokens)
    accepted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wire_seconds: float = 0.0
    total_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    first_step_tokens: int = 0  # tokens the first step returned; decoding is what comes after
    wire_bytes: int = 0
    draft_failures: int = 0
    runahead_steps: int = 0  # steps during whose Verify the draft ran ahead (overlap.py)
    runahead_hits: int = 0  # ... and whose run-ahead became the next step's draft
    runahead_tokens: int = 0  # draft tokens drafted ahead (the bonus guesses included)
    runahead_used_tokens: int = 0  # ... of them that became canonical or the next draft
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0
