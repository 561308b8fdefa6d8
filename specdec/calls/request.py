"""The two calls of a step, Propose and Verify, and the Verify's result: the types every layer
passes. The coordinator's loop (or a target's drafted run) builds a call, its gRPC client
translates it to the protobuf and the service's servicer back, and the in-process proposer and
verifier (coordinator/local.py) hand it straight to the engine; the result goes back the same way.
Every translation sits in specdec/serving/wire.py. No gRPC here."""

from __future__ import annotations

import dataclasses
from typing import Any

from specdec.maths.sampling import SamplingConfig, TokenLogprob
from specdec.maths.tree import DraftTree, SparseDist


@dataclasses.dataclass(frozen=True)
class TreeSettings:
    """How a request drafts trees, end to end (the request's validation, the coordinator's loop, the
    wire's TreeParams, the draft's TreeBuilder): at most `budget` nodes, `top_k` children per
    expanded node (dynamic), or `shape[d]` children per node at depth d (static). How deep a tree
    goes is not here: the draft length caps it, as it caps a chain (ProposeCall.draft_length)."""

    budget: int
    top_k: int = 4
    shape: tuple[int, ...] = ()  # empty: dynamic


@dataclasses.dataclass(frozen=True)
class ProposeCall:
    """One ask of the draft: the tokens it has not seen (`append`, past the `known_len` it holds),
    then a chain of at most `draft_length` tokens, or a tree (`tree`) at most `draft_length` deep.

    Why one type with an optional tree, not a second call type: a tree ask differs from a chain's
    by its shape alone (its depth is the same draft length, its sampling the same temperature and
    seed), as a Verify of a tree differs from a chain's by `VerifyCall.tree`. The wire keeps two
    RPCs (Propose streams tokens, ProposeTree answers one tree); the translations pick by `tree`."""

    sequence_id: str
    known_len: int
    append: list[int]
    draft_length: int  # chains: most tokens; trees: deepest level (wire: max_tokens, TreeParams.max_depth)
    # chains: stop once the product of the drafted tokens' probabilities falls under this (0: never)
    min_cumulative_prob: float = 0.0
    temperature: float = 0.0  # the draft's; 0 proposes its argmax with p = 1
    seed: int = 0  # this call's draws (derived from the request's seed and position: specdec/maths/sampling.py)
    # for a feature draft (chains and trees): the target's hidden states it does not hold yet, a FeatureRows
    # (specdec/model/features.py), which the maths may not import
    features: Any = None
    tree: TreeSettings | None = None  # a tree proposal instead of a chain


@dataclasses.dataclass(frozen=True)
class VerifyCall:
    """A chain (draft_tokens, one dist each or none) or a tree (`tree`), after the tokens the target
    has not seen (`append`, past the `known_len` it holds)."""

    sequence_id: str
    known_len: int
    append: list[int]
    draft_tokens: list[int]
    draft_dists: list[SparseDist]  # empty, or one per draft token (EMPTY_DIST: one-hot)
    sampling: SamplingConfig
    tree: DraftTree | None = None  # a tree proposal instead of draft_tokens
    return_features: bool = False  # for a feature draft (specdec/model/feature_draft.py)
    decode_ahead: int = 0  # after the verdict, decode up to this many more tokens alone (target_service/engine.py)
    logprobs: int | None = None  # report the log-probabilities of the tokens made canonical, with this many alternatives
    eos_banned_until: int = 0  # positions below this never get an end-of-sequence token (a request's min_tokens)
    # on each pass without a draft of its own (this one's if draft_tokens is empty, each one decoded
    # ahead), the target drafts by prompt lookup over the sequence's own tokens, at most this many
    # tokens, cut where the expected tokens per unit of `lookup_costs` peak (specdec/maths/lookup.py)
    lookup_draft_length: int = 0  # wire: lookup_max_tokens
    lookup_costs: tuple[float, ...] = ()  # V(n) / V(1) for n = 1, 2, ...; empty: no cut
    decode_ahead_passes: int = 0  # with decode_ahead: at most this many passes after this one (0: decode_ahead's tokens bound them)
    lookup_source: tuple[int, ...] = ()  # tokens the lookup drafts from besides the sequence's (a predicted output)
    prefill: int = 0  # the target's own: canonical tokens it holds but has not fed yet (a prompt fed in chunks)
    # the target's own: draft_tokens are its lookup draft, not the caller's: the match's n and the whole proposal
    lookup_match: tuple[int, tuple[int, ...]] | None = None

    @property
    def new_positions(self) -> int:
        """Positions this call feeds the target (what batching pads to)."""
        return self.prefill + len(self.append) + len(self.draft_tokens) + (len(self.tree.tokens) if self.tree else 0)


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """The target's verdict on a VerifyCall, as its engine makes it and as the coordinator's loop
    reads it, through the wire or in-process.

    Why one type, not one per side or a wrapper: all but three fields are one quantity that both
    sides name alike, and those three keep their defaults on the side that cannot know them. Only
    the target knows `batch_size` (it is not sent); only the coordinator, around the call, can
    measure `wall_seconds` and `wire_bytes`."""

    accepted: int
    next_token: int
    cached_len: int  # tokens the target holds for the sequence after this call
    compute_seconds: float
    path: tuple[int, ...] = ()  # tree drafts: the accepted nodes, root to leaf (accepted == len(path))
    # return_features: hidden states of the positions made canonical, a FeatureRows
    # (specdec/model/features.py), which the maths may not import
    features: Any = None
    decoded: tuple[int, ...] = ()  # decode_ahead: tokens decoded after next_token (the last one is pending)
    logprobs: tuple[TokenLogprob, ...] = ()  # asked for: one per token made canonical (accepted, next, decoded)
    ahead_passes: int = 0  # decode_ahead: the forwards it took (fewer than len(decoded) when lookup drafts were accepted)
    ahead_drafted: int = 0  # lookup_draft_length: tokens the target drafted for itself (this pass's too, when it drafted it)
    ahead_accepted: int = 0  # of which it accepted
    predicted_drafted: int = 0  # of ahead_drafted, tokens from a predicted output (VerifyCall.lookup_source)
    predicted_accepted: int = 0  # of which it accepted
    ahead_seconds: float = 0.0  # decode_ahead: of compute_seconds, the passes after the call's own
    ahead_tokens: int = 0  # decode_ahead: of decoded, the tokens those passes made
    batch_size: int = 1  # the target's: rows in the forward pass this result came from
    wall_seconds: float = 0.0  # the coordinator's: the call end to end, the wire's time included (0: not measured)
    wire_bytes: int = 0  # the coordinator's: the request's and the response's bytes on the wire

    @property
    def passes(self) -> int:
        """Target forwards this Verify took."""
        # A target that does not say (before lookup_draft_length) took one per decoded token.
        return 1 + (self.ahead_passes if self.ahead_passes or self.ahead_drafted else len(self.decoded))
