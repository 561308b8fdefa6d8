"""The verification maths: which draft tokens the target keeps, and its own next token.

Pure functions over tensors, with the randomness passed in as uniforms, so they are unit-tested
without models, gRPC or seeds (tests/test_verify.py). Rows are sequences of a batch; each row has its
own draft length (`draft_lens`), and positions at or past it are padding.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x_i, drawn from p_i, is
accepted with probability min(1, q_i(x_i) / p_i(x_i)); at the first rejection the target's token is
drawn from norm(max(0, q_i - p_i)); after a full accept the bonus token is drawn from q_g. The tokens
that come out follow q exactly, whatever p is, as long as p is what the drafts were drawn from.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Per row: how many draft tokens were accepted and the target's own token after them."""

    accepted: torch.Tensor  # [B] int64, in [0, draft_len]
    next_tokens: torch.Tensor  # [B] int64: the correction, or the bonus token after a full accept


def _valid_mask(draft_tokens: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)  # [G]
    return positions[None, :] < draft_lens[:, None]  # [B, G]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row. mask: [B, G] bool -> [B] int64."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_lens: torch.Tensor) -> Verdict:
    """Keeps the longest draft prefix equal to the target's argmax, then the target's argmax.

    target_logits: [B, G+1, V] (position i scores the token after draft token i-1);
    draft_tokens: [B, G]; draft_lens: [B].
    """
    argmax = target_logits.argmax(dim=-1)  # [B, G+1]
    matches = (draft_tokens == argmax[:, :-1]) & _valid_mask(draft_tokens, draft_lens)  # [B, G]
    accepted = _leading_true(matches)  # [B]
    next_tokens = argmax.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return Verdict(accepted=accepted, next_tokens=next_tokens)


def verify_greedy_row(target_logits: torch.Tensor, draft_tokens: list[int]) -> tuple[int, int]:
    """verify_greedy for one sequence: (accepted, next token), from target_logits [G+1, V].

    Why a row of its own: the target verifies each row of a pass apart (its verdicts are per row),
    and the batched form's tensors and masks are Python around one argmax, paid by every row of
    every pass. One argmax call, then the same rule on a list."""
    return _greedy_verdict(target_logits.argmax(dim=-1).tolist(), draft_tokens)


def _greedy_verdict(argmax: list[int], draft_tokens: list[int]) -> tuple[int, int]:
    """(accepted, next token): the longest draft prefix equal to the target's argmax, then its own token."""
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == argmax[accepted]:
        accepted += 1
    return accepted, argmax[accepted]


def verify_greedy_rows(rows_logits: list[torch.Tensor], drafts: list[list[int]]) -> list[tuple[int, int]]:
    """verify_greedy_row for every row of a pass: [(accepted, next token)], from each row's logits
    [G_i + 1, V] (on any device) and its draft.

    Why all rows at once: one argmax over the pass and one copy of token ids to the host, not a
    copy of every row's full-vocabulary logits (a GPU pass of 64 rows would ship 12 MB of them and
    wait on the device once per row). The rule per row is verify_greedy_row's, on the same argmax
    (the first maximal index on every device), so the verdicts are the same bits."""
    if not rows_logits:
        return []
    flat = torch.cat(rows_logits) if len(rows_logits) > 1 else rows_logits[0]
    ids = flat.argmax(dim=-1).tolist()
    verdicts, at = [], 0
    for logits, draft in zip(rows_logits, drafts):
        verdicts.append(_greedy_verdict(ids[at:at + logits.shape[0]], draft))
        at += logits.shape[0]
    return verdicts


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [B, V] (unnormalised, >= 0, positive sum); uniforms: [B] in [0, 1).

    A token with probability 0 is never returned: its CDF step is empty. Float64 keeps the rounding
    of a 50k-entry cumulative sum far below what any test can see.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    threshold = uniforms.double() * cdf[:, -1]  # [B]
    index = (cdf <= threshold[:, None]).sum(dim=-1)  # first position whose CDF exceeds the threshold
    # A uniform that rounds up to 1.0 would fall off the end: take the last token with mass instead.
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_positive = torch.where(probs > 0, positions, -1).amax(dim=-1)  # [B]
    return torch.minimum(index, last_positive)


def verify_rejection(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_lens: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> Verdict:
    """Speculative rejection sampling.

    target_probs: [B, G+1, V] q after the request's temperature / top-k / top-p;
    draft_tokens: [B, G]; draft_probs: [B, G, V] the p each draft token was drawn from;
    draft_lens: [B]; accept_uniforms: [B, G] and sample_uniforms: [B], uniform in [0, 1).
    """
    batch, gamma = draft_tokens.shape
    q_of_draft = target_probs[:, :gamma].gather(2, draft_tokens[..., None]).squeeze(2)  # [B, G]
    p_of_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)  # [B, G]
    # u < q/p without dividing: a token the target gives 0 is never accepted.
    accept = (accept_uniforms * p_of_draft < q_of_draft) & _valid_mask(draft_tokens, draft_lens)
    accepted = _leading_true(accept)  # [B]

    rows = torch.arange(batch, device=draft_tokens.device)
    q_next = target_probs[rows, accepted]  # [B, V]
    # p is zero past each row's draft, so after a full accept the residual is q itself (bonus).
    p_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)  # [B, G+1, V]
    p_next = p_padded[rows, accepted] * (accepted < draft_lens)[:, None]  # [B, V]
    residual = (q_next - p_next).clamp(min=0)  # [B, V]
    # q <= p everywhere means q == p: rejection had probability 0 there; fall back to q for safety.
    empty = residual.sum(dim=-1) <= 0
    residual = torch.where(empty[:, None], q_next, residual)
    return Verdict(accepted=accepted, next_tokens=sample_from(residual, sample_uniforms))
