"""Whether a Propose or a Verify may be computed: the one copy of each call's checks. The target
engine runs a Verify's on each row before any forward (and the coordinator's validator its token
check on a prompt, so a client sees the same refusal from either); the draft engine runs a
Propose's before it syncs the sequence. Each check raises InvalidArgument naming the wire's field
(`draft_dists[2]`, `draft_tree.parents[3]`, `max_tokens` for a ProposeCall's draft_length); they run
in field order, so the first bad one is named."""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec.errors import InvalidArgument
from specdec.limits import (MAX_DECODE_AHEAD, MAX_DRAFT_TOKENS, MAX_LOGPROBS, MAX_LOOKUP_SOURCE, MAX_TREE_DEPTH,
                            MAX_TREE_NODES, MAX_VERIFY_POSITIONS)
from specdec.calls.request import ProposeCall, VerifyCall
from specdec.maths.sampling import check_sampling, check_temperature
from specdec.maths.tree import SparseDist, check_parents, check_tree_bounds
from specdec.maths.treeplan import draft_probs

TREE_FIELDS = {"budget": "tree.budget", "top_k": "tree.top_k", "shape": "tree.shape"}  # ProposeTreeRequest's
NOT_A_DISTRIBUTION = "needs distinct in-vocabulary ids, one prob each, in [0, 1], summing to 1"


def check_token_ids(field: str, ids: Sequence[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(field, f"token id {bad[0]} outside the target's vocabulary [0, {vocab})")


def is_distribution(ids: Sequence[int], probs: Sequence[float], vocab: int) -> bool:
    """A sparse p the rejection sampler can use: NaN, inf or mass that does not sum to 1 would skew it."""
    return (
        len(ids) == len(probs) == len(set(ids))
        and all(0 <= t < vocab for t in ids)
        and all(0 <= p <= 1 for p in probs)  # also rejects NaN
        and abs(math.fsum(probs) - 1) <= 1e-3
    )


def check_dist(field: str, dist: SparseDist, vocab: int) -> None:
    """A distribution, or EMPTY_DIST (one-hot); an empty id list with probabilities is neither."""
    ids, probs = dist
    if (ids or probs) and not is_distribution(ids, probs, vocab):
        raise InvalidArgument(field, NOT_A_DISTRIBUTION)


def check_propose_call(call: ProposeCall, vocab: int) -> None:
    """Every check of one Propose against a draft of `vocab` tokens (0: it takes any id). The
    draft length is the wire's `max_tokens` for a chain and `tree.max_depth` for a tree."""
    if call.tree is None:
        if not 0 <= call.draft_length <= MAX_DRAFT_TOKENS:
            raise InvalidArgument("max_tokens", f"must be in [0, {MAX_DRAFT_TOKENS}], got {call.draft_length}")
    else:
        tree = call.tree
        check_tree_bounds(tree.budget, tree.top_k, tree.shape, TREE_FIELDS, check_top_k=not tree.shape)
        if not 1 <= call.draft_length <= MAX_TREE_DEPTH:
            raise InvalidArgument("tree.max_depth", f"must be in [1, {MAX_TREE_DEPTH}], got {call.draft_length}")
    check_temperature(call.temperature)
    if vocab and any(not 0 <= t < vocab for t in call.append):
        raise InvalidArgument("append_tokens", f"token ids must be in the draft's vocabulary [0, {vocab})")


def check_verify_call(call: VerifyCall, vocab: int, has_features: bool = True) -> None:
    """Every check of one Verify against a target of `vocab` tokens; `has_features`: whether that
    target can return hidden states (return_features)."""
    _check_chain(call, vocab)
    if call.tree is not None:
        _check_tree(call, vocab)
    if call.return_features and not has_features:
        raise InvalidArgument("return_features", "this target model has no final norm to read hidden states from")
    if not 0 <= call.decode_ahead <= MAX_DECODE_AHEAD:
        raise InvalidArgument("decode_ahead", f"must be in [0, {MAX_DECODE_AHEAD}], got {call.decode_ahead}")
    if call.decode_ahead and call.tree is not None:
        raise InvalidArgument("decode_ahead", "is for chains: a draft_tree cannot decode ahead")
    if not 0 <= call.decode_ahead_passes <= MAX_DECODE_AHEAD:
        raise InvalidArgument("decode_ahead_passes", f"must be in [0, {MAX_DECODE_AHEAD}], got {call.decode_ahead_passes}")
    if not 0 <= call.lookup_draft_length <= MAX_DRAFT_TOKENS:
        raise InvalidArgument("lookup_max_tokens", f"must be in [0, {MAX_DRAFT_TOKENS}], got {call.lookup_draft_length}")
    if call.lookup_draft_length and (call.return_features or call.tree is not None):
        raise InvalidArgument("lookup_max_tokens", "is for chains without return_features (a feature draft drafts for itself)")
    if len(call.lookup_costs) > MAX_VERIFY_POSITIONS or not all(0 < c < math.inf for c in call.lookup_costs):
        raise InvalidArgument("lookup_costs", f"at most {MAX_VERIFY_POSITIONS} values, each positive and finite")
    if len(call.lookup_source) > MAX_LOOKUP_SOURCE:
        raise InvalidArgument("lookup_source", f"at most {MAX_LOOKUP_SOURCE} tokens, got {len(call.lookup_source)}")
    check_token_ids("lookup_source", call.lookup_source, vocab)
    if call.logprobs is not None and not 0 <= call.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {call.logprobs}")
    if call.tree is not None and (call.logprobs is not None or call.eos_banned_until):
        raise InvalidArgument("draft_tree", "logprobs and eos_banned_until are for chains")


def _check_chain(call: VerifyCall, vocab: int) -> None:
    """The tokens, the chain's distributions (each must give its token a chance) and the sampling."""
    check_token_ids("append_tokens", call.append, vocab)
    check_token_ids("draft_tokens", call.draft_tokens, vocab)
    tokens, dists = call.draft_tokens, call.draft_dists
    if len(tokens) > MAX_DRAFT_TOKENS:
        raise InvalidArgument("draft_tokens", f"at most {MAX_DRAFT_TOKENS} per call, got {len(tokens)}")
    if dists and len(dists) != len(tokens):
        raise InvalidArgument("draft_dists", f"one per draft token: got {len(dists)} for {len(tokens)} tokens")
    for i, (ids, probs) in enumerate(dists):
        check_dist(f"draft_dists[{i}]", (ids, probs), vocab)
        if ids and not any(t == tokens[i] and p > 0 for t, p in zip(ids, probs)):
            raise InvalidArgument(f"draft_dists[{i}]", f"draft token {tokens[i]} has probability 0 in the p it was drawn from")
    check_sampling(call.sampling)


def _check_tree(call: VerifyCall, vocab: int) -> None:
    """The tree's layout, tokens and distributions; when sampling, that each node could have been drawn."""
    tree = call.tree
    if call.draft_tokens:
        raise InvalidArgument("draft_tree", "send draft_tokens or draft_tree, not both")
    if len(tree.tokens) > MAX_TREE_NODES:
        raise InvalidArgument("draft_tree.tokens", f"at most {MAX_TREE_NODES} nodes per call, got {len(tree.tokens)}")
    if len(tree.parents) != len(tree.tokens):
        raise InvalidArgument("draft_tree.parents", f"one per node: got {len(tree.parents)} for {len(tree.tokens)} tokens")
    check_parents(list(tree.parents), "draft_tree.parents")
    check_token_ids("draft_tree.tokens", tree.tokens, vocab)
    if tree.child_dists and len(tree.child_dists) != len(tree.tokens) + 1:
        raise InvalidArgument("draft_tree.child_dists",
                              f"one per position (root + nodes): got {len(tree.child_dists)} for {len(tree.tokens) + 1}")
    for j, dist in enumerate(tree.child_dists):
        check_dist(f"draft_tree.child_dists[{j}]", dist, vocab)
    if not call.sampling.greedy:  # raises for a child its distribution could not have drawn
        draft_probs(tree.parents, tree.tokens, tree.child_dists, call.sampling, vocab)
