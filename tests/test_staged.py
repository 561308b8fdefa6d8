"""Staged drafting (draft_service/drafters/staged.py): the draft's greedy tokens, in fewer draft forwards.

The staged drafter must propose exactly what the plain greedy drafter proposes, call after call,
through rollbacks and re-fills; it must need fewer draft-model passes where the text repeats; and
the whole loop, in process and through gRPC, must give the target's own greedy output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from specdec.maths.costs import MODEL_DRAFT_PRIOR
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import GenerationSpec, Stats
from specdec.calls.request import ProposeCall
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from target_service.engine import TargetEngine
from tests import tiny
from tests.stack import Stack

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=0)


def test_staged_proposals_are_the_plain_greedy_proposals(pair):
    """Same calls to both engines: random draft lengths, rollbacks of drafted tokens, catch-up
    tokens, thresholds, and a sequence re-sent from scratch; every proposal must agree."""
    draft = pair[1]
    plain = DraftEngine(ModelDrafter(CausalLM(draft, CPU)))
    staged_drafter = ModelDrafter(CausalLM(draft, CPU), staged=True)
    staged = DraftEngine(staged_drafter)
    rng = random.Random(4)
    for index, prompt in enumerate(tiny.prompts(6, seed=8)):
        name, tokens, known = f"s{index}", list(prompt), 0
        for step in range(14):
            settings = ProposeCall("", 0, [], rng.choice([1, 3, 6, 12, 20]), rng.choice([0.0, 0.0, 0.01]), 0.0, 0)
            if step == 7:
                known = 0  # the coordinator re-sends the sequence whole (a lost cache)
            a = [p.token for p in plain.propose(dataclasses.replace(settings, sequence_id=name, known_len=known, append=tokens[known:]))]
            b = [p.token for p in staged.propose(dataclasses.replace(settings, sequence_id=name, known_len=known, append=tokens[known:]))]
            assert a == b, f"prompt {index} step {step}"
            # the "target" keeps a random prefix of the proposal and adds a token of its own
            kept = rng.randint(0, len(a))
            known = len(tokens) + kept
            tokens += a[:kept] + [rng.randrange(256) if rng.random() < 0.3 else (a[kept] if kept < len(a) else 7)]
    assert staged_drafter.forwards > 0


def test_staging_saves_draft_forwards_where_the_text_repeats(pair):
    draft = pair[1]
    plain_drafter, staged_drafter = ModelDrafter(CausalLM(draft, CPU)), ModelDrafter(CausalLM(draft, CPU), staged=True)
    plain, staged = DraftEngine(plain_drafter), DraftEngine(staged_drafter)
    settings = ProposeCall("", 0, [], 16)
    for index, prompt in enumerate(tiny.prompts(6, seed=2)):
        tokens, known = list(prompt), 0
        for _ in range(6):  # accept everything: the draft generates freely, as an agreeing target would
            a = [p.token for p in plain.propose(dataclasses.replace(settings, sequence_id=f"s{index}", known_len=known, append=tokens[known:]))]
            b = [p.token for p in staged.propose(dataclasses.replace(settings, sequence_id=f"s{index}", known_len=known, append=tokens[known:]))]
            assert a == b
            known = len(tokens) + len(a)
            tokens += a + [7]
    assert staged_drafter.forwards < plain_drafter.forwards


def _loop_tokens(pair, prompt, draft_length):
    target, draft = pair
    loop = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(target, CPU))),
                           LocalProposer(DraftEngine(ModelDrafter(CausalLM(draft, CPU), staged=True))), None, MODEL_DRAFT_PRIOR)
    spec = GenerationSpec("r", list(prompt), 24, SamplingConfig(), draft_length, False, frozenset({tiny.EOS}), seeded=True)

    async def collect():
        return [t for step in [s async for s in loop.run(spec, Stats())] for t in step.tokens]

    return asyncio.run(collect())


@pytest.mark.parametrize("draft_length", [1, 4, 8])
def test_staged_loop_matches_the_target_alone(pair, draft_length):
    for prompt in tiny.prompts(6, seed=14):
        assert _loop_tokens(pair, prompt, draft_length) == tiny.reference_greedy(pair[0], prompt, 24)


def test_staged_draft_through_grpc_matches_the_target_alone(pair, tmp_path):
    target, draft = pair
    stack = Stack()
    try:
        target_addr = stack.target(tiny.save(target, tmp_path / "target"))
        draft_addr = stack.draft(drafter="model", model=tiny.save(draft, tmp_path / "draft"), staged=True)
        client = stack.client(stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer()))
        accepted = 0
        for prompt in tiny.prompts(8):
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=24,
                                         speculation=pb.SpeculationParams(draft_length=6, adaptive=False))
            response = client.Generate(request, timeout=60)
            assert list(response.token_ids) == tiny.reference_greedy(target, prompt, 24)
            accepted += response.stats.accepted_tokens
        assert accepted > 0
    finally:
        stack.stop()
