"""One Verify request, the one type every layer passes: the coordinator's loop builds it, its gRPC
client translates it to the protobuf and the target's servicer back, and the in-process verifier
(coordinator/local.py) hands it straight to the target engine. No gRPC here."""

from __future__ import annotations

import dataclasses

from specdec.spec.sampling import SamplingConfig
from specdec.spec.tree import DraftTree, SparseDist


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
    # tokens, cut where the expected tokens per unit of `lookup_costs` peak (specdec/spec/lookup.py)
    lookup_max_tokens: int = 0
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
