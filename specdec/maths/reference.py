"""A reference speculative loop, short enough to check by eye: the oracle the services are tested against.

Speculative sampling as Leviathan et al. (2023) and Chen et al. (2023) state it, and as gpt-fast
writes it: the draft proposes k tokens, drawn from its distributions p; ONE target forward over
them gives q at every draft position and one past them; token i is kept with probability
min(1, q(x_i) / p(x_i)); at the first rejection a token is drawn from norm(max(0, q - p)), and
when all k are kept a bonus token is drawn from the last q. The output then follows the target's
own distribution. Greedy (temperature 0) is the same rule over one-hot distributions: a draft token
is kept iff it is the target's argmax, and the residual is the target's argmax.

No caches, no batching, no services: each call re-reads the whole sequence. `target` and `draft`
are plain callables, [1, T] token ids -> [1, T, V] logits (an HF causal LM's `lambda ids:
model(ids).logits`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Logits = Callable[[torch.Tensor], torch.Tensor]


def _dist(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities: softmax at `temperature`, one-hot argmax at 0."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return torch.softmax(logits.double() / temperature, dim=-1)


@torch.inference_mode()
def speculative_generate(target: Logits, draft: Logits, prompt: list[int], max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, eos_token_ids: frozenset[int] = frozenset(),
                         generator: torch.Generator | None = None) -> list[int]:
    """Up to max_new_tokens new tokens after `prompt`, through the first end-of-sequence token."""
    tokens = list(prompt)

    def draw(dist: torch.Tensor) -> int:
        return int(torch.multinomial(dist.float(), 1, generator=generator))

    while len(tokens) - len(prompt) < max_new_tokens and not eos_token_ids & set(tokens[len(prompt):]):
        drafted, ps = [], []
        for _ in range(k):
            p = _dist(draft(torch.tensor([tokens + drafted]))[0, -1], temperature)  # [V]
            drafted.append(draw(p))
            ps.append(p)
        qs = _dist(target(torch.tensor([tokens + drafted]))[0, -k - 1:], temperature)  # [k + 1, V]
        kept = 0
        while kept < k:
            x, p, q = drafted[kept], ps[kept], qs[kept]
            if float(torch.rand((), generator=generator, dtype=torch.float64)) >= min(1.0, float(q[x] / p[x])):
                break
            kept += 1
        if kept < k:
            residual = (qs[kept] - ps[kept]).clamp(min=0)
            nxt = draw(residual / residual.sum())
        else:
            nxt = draw(qs[k])  # the bonus token
        tokens += drafted[:kept] + [nxt]
    new = tokens[len(prompt):len(prompt) + max_new_tokens]
    ends = [i for i, t in enumerate(new) if t in eos_token_ids]
    return new[: ends[0] + 1] if ends else new
