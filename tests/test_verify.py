"""The verification maths, with hand-built logits and a statistical test of losslessness."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specdec.maths.sampling import SamplingConfig, target_probs
from specdec.maths.verify import sample_from, verify_greedy, verify_greedy_row, verify_greedy_rows, verify_rejection

# Each chi-square test below fails by chance with probability FALSE_ALARM when the maths is right.
FALSE_ALARM = 1e-4


def one_hot_logits(tokens: list[int], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accepts_longest_matching_prefix_then_target_token():
    target = one_hot_logits([3, 1, 4, 1], vocab=8)[None]  # argmax per position
    verdict = verify_greedy(target, torch.tensor([[3, 1, 5]]), torch.tensor([3]))
    assert verdict.accepted.tolist() == [2]
    assert verdict.next_tokens.tolist() == [4]  # the correction


def test_greedy_full_accept_gives_bonus_token():
    target = one_hot_logits([3, 1, 4, 1], vocab=8)[None]
    verdict = verify_greedy(target, torch.tensor([[3, 1, 4]]), torch.tensor([3]))
    assert verdict.accepted.tolist() == [3]
    assert verdict.next_tokens.tolist() == [1]  # the bonus


def test_greedy_rows_with_different_draft_lengths_ignore_padding():
    target = torch.stack([one_hot_logits([3, 1, 4, 1], 8), one_hot_logits([2, 2, 2, 2], 8)])
    drafts = torch.tensor([[3, 1, 4], [2, 0, 0]])  # row 1 has one real token; the rest is padding
    verdict = verify_greedy(target, drafts, torch.tensor([2, 1]))
    assert verdict.accepted.tolist() == [2, 1]
    assert verdict.next_tokens.tolist() == [4, 2]


def test_empty_draft_is_a_plain_decoding_step():
    target = one_hot_logits([6], vocab=8)[None]
    verdict = verify_greedy(target, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    assert verdict.accepted.tolist() == [0] and verdict.next_tokens.tolist() == [6]


def test_rejection_with_empty_draft_samples_from_q():
    q = torch.tensor([[[0.0, 0.0, 1.0]]])
    empty = torch.zeros(1, 0, dtype=torch.long)
    verdict = verify_rejection(q, empty, torch.zeros(1, 0, 3), torch.tensor([0]), torch.zeros(1, 0), torch.tensor([0.5]))
    assert verdict.accepted.tolist() == [0] and verdict.next_tokens.tolist() == [2]


def test_rejection_never_accepts_a_token_the_target_forbids():
    q = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # target never says token 0 first
    p = torch.tensor([[[1.0, 0.0]]])
    verdict = verify_rejection(q, torch.tensor([[0]]), p, torch.tensor([1]), torch.zeros(1, 1), torch.tensor([0.3]))
    assert verdict.accepted.tolist() == [0] and verdict.next_tokens.tolist() == [1]


def test_sample_from_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(1000, 1)
    tokens = sample_from(probs, torch.rand(1000, generator=torch.Generator().manual_seed(1)))
    assert set(tokens.tolist()) <= {1, 3}
    edges = sample_from(probs[:2], torch.tensor([0.0, 1.0 - 1e-12]))
    assert edges.tolist() == [1, 3]


def _emitted(verdict, drafts: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each row emits at output position `position`, and which rows reach it."""
    accepted, nxt = verdict.accepted, verdict.next_tokens
    reaches = accepted >= position
    token = torch.where(accepted > position, drafts[:, min(position, drafts.shape[1] - 1)], nxt)
    return token[reaches], reaches


def _chi_square_pvalue(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = expected_probs[support].double() * counts.sum()
    return stats.chisquare(counts[support].numpy(), expected.numpy() * counts[support].sum().item() / expected.sum().item()).pvalue


def _run_speculation(q: torch.Tensor, p: torch.Tensor, samples: int, seed: int, verifier=verify_rejection):
    """Draws drafts from p and verifies them against q, `samples` independent rows at once."""
    gamma, vocab = p.shape
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(p, samples, replacement=True, generator=gen).T.contiguous()  # [N, G]
    verdict = verifier(
        q[None].expand(samples, -1, -1),
        drafts,
        p[None].expand(samples, -1, -1),
        torch.full((samples,), gamma),
        torch.rand(samples, gamma, generator=gen),
        torch.rand(samples, generator=gen),
    )
    return verdict, drafts


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_k=5),
        SamplingConfig(temperature=1.3, top_p=0.8),
        SamplingConfig(temperature=0.9, top_k=6, top_p=0.9),
    ],
)
def test_rejection_sampling_output_follows_target_distribution(sampling):
    """40k rows: the token emitted at positions 0, 1 and 2 follows q at that position."""
    vocab, gamma, samples = 10, 3, 40_000
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(gamma + 1, vocab, generator=gen) * 2
    q = target_probs(target_logits, sampling)  # [G+1, V] after temperature / top-k / top-p
    noise = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 2, dim=-1)
    p = 0.6 * q[:gamma] + 0.4 * noise  # a draft that agrees often, and puts mass where q has none
    verdict, drafts = _run_speculation(q, p, samples, seed=11)
    for position in range(gamma + 1):
        tokens, reaches = _emitted(verdict, drafts, position)
        assert reaches.sum() > 2_000
        assert _chi_square_pvalue(tokens, q[position]) > FALSE_ALARM, f"position {position}"


def test_distribution_test_catches_a_biased_verifier():
    """The same test rejects a verifier that skips the residual (resamples from q): it has power."""

    def biased(q, drafts, p, lens, u_accept, u_sample):
        verdict = verify_rejection(q, drafts, p, lens, u_accept, u_sample)
        rows = torch.arange(q.shape[0])
        return type(verdict)(verdict.accepted, sample_from(q[rows, verdict.accepted], u_sample))

    vocab, gamma = 10, 2
    gen = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(gamma + 1, vocab, generator=gen) * 2, dim=-1)
    p = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 2, dim=-1)
    verdict, drafts = _run_speculation(q, p, 40_000, seed=5, verifier=biased)
    tokens, _ = _emitted(verdict, drafts, 0)
    assert _chi_square_pvalue(tokens, q[0]) < FALSE_ALARM


def test_one_hot_draft_is_lossless():
    """An n-gram drafter sends p one-hot; acceptance is then q(x) and the output still follows q."""
    vocab, samples = 6, 30_000
    q = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(2)), dim=-1)
    p = torch.zeros(1, vocab)
    p[0, 4] = 1.0
    verdict, drafts = _run_speculation(q, p, samples, seed=9)
    tokens, _ = _emitted(verdict, drafts, 0)
    assert _chi_square_pvalue(tokens, q[0]) > FALSE_ALARM
    assert abs(verdict.accepted.float().mean().item() - q[0, 4].item()) < 0.02


def test_rejection_sampling_is_a_pure_function_of_its_uniforms():
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(4, 5, 12, generator=gen), -1)
    p = torch.softmax(torch.randn(4, 4, 12, generator=gen), -1)
    drafts = torch.randint(0, 12, (4, 4), generator=gen)
    u, v = torch.rand(4, 4, generator=gen), torch.rand(4, generator=gen)
    lens = torch.tensor([4, 2, 0, 3])
    first = verify_rejection(q, drafts, p, lens, u, v)
    second = verify_rejection(q, drafts, p, lens, u, v)
    assert torch.equal(first.accepted, second.accepted) and torch.equal(first.next_tokens, second.next_tokens)
    assert (first.accepted <= lens).all()


def test_the_one_row_greedy_rule_is_the_batched_ones():
    """verify_greedy_row on each row alone gives verify_greedy's verdict: full, partial and no
    accepts, empty drafts, and ties (few distinct logit values), where both take the first argmax."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        g = trial % 5
        logits = torch.randint(0, 3, (g + 1, 6), generator=gen).float()  # ties everywhere
        best = logits.argmax(dim=-1)
        drafts = [int(best[i]) if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(0, 6, (1,), generator=gen))
                  for i in range(g)]
        batched = verify_greedy(logits[None], torch.tensor([drafts], dtype=torch.long).reshape(1, g), torch.tensor([g]))
        assert verify_greedy_row(logits, drafts) == (int(batched.accepted[0]), int(batched.next_tokens[0]))


def test_the_passs_greedy_verdicts_are_each_rows_own():
    """verify_greedy_rows (one argmax for a whole pass) gives every row verify_greedy_row's verdict,
    ties included (coarse logits make many): rows of 1 to 6 positions, drafts that follow the
    argmax for a while and then stray."""
    gen = torch.Generator().manual_seed(7)
    rows, drafts = [], []
    for i in range(40):
        n = 1 + i % 6
        logits = torch.randint(0, 4, (n, 11), generator=gen).float()  # ties in most rows
        argmax = logits.argmax(-1).tolist()
        keep = i % n
        draft = argmax[:keep] + [(argmax[keep] + 1) % 11] * (n - 1 - keep) if n > 1 else []
        rows.append(logits)
        drafts.append(draft[:n - 1])
    assert verify_greedy_rows(rows, drafts) == [verify_greedy_row(r, d) for r, d in zip(rows, drafts)]
    assert verify_greedy_rows([], []) == []
