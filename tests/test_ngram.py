"""The n-gram drafter: the lookup rule, and its incremental index with rollback."""

import random

import pytest

from specdec.calls.request import ProposeCall
from draft_service.drafters.ngram import NgramDrafter
from draft_service.engine import DraftEngine
from draft_service.drafters.ngram import MatchCalibration, NgramIndex, ngram_propose


def test_proposes_continuation_of_most_recent_longest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_propose(tokens, 3) == [7, 8, 5]  # the later "1 2 3" wins


def test_falls_back_to_shorter_ngrams_and_caps_length():
    assert ngram_propose([4, 5, 6, 0, 6], 2, max_n=3) == [0, 6]
    assert ngram_propose([4, 5, 6, 0, 6], 1, max_n=3) == [0]


def test_no_match_or_nothing_asked_gives_nothing():
    assert ngram_propose([1, 2, 3, 4], 5) == []
    assert ngram_propose([1, 1], 0) == []
    assert ngram_propose([7], 4) == []


def test_min_n_rejects_short_matches():
    assert ngram_propose([3, 8, 1, 3], 2, max_n=3, min_n=2) == []
    assert ngram_propose([3, 8, 1, 3], 2, max_n=3, min_n=1) == [8, 1]


# --- the incremental index the draft service uses -------------------------------------------


def brute_force(tokens: list[int], max_tokens: int, max_n: int, min_n: int) -> list[int]:
    """The rule spelled out as a rescan: longest suffix first, most recent earlier occurrence, periodic tail."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):  # `end`: where the occurrence's continuation starts
            if tokens[end - n: end] == suffix:
                out = tokens[end: end + max_tokens]
                while len(out) < max_tokens:
                    out.append(out[len(out) - (length - end)])
                return out
    return []


def test_index_matches_a_rescan_through_appends_and_rollbacks():
    rng = random.Random(0)
    index = NgramIndex(max_n=4, min_n=1)
    shadow: list[int] = []
    for _ in range(3000):
        if shadow and rng.random() < 0.2:
            drop = rng.randint(1, min(6, len(shadow)))
            index.crop(-drop)
            del shadow[-drop:]
        else:
            token = rng.randrange(6)  # a small alphabet: many matches at every n
            index.append(token)
            shadow.append(token)
        assert len(index) == len(shadow)
        assert index.propose(5)[0] == brute_force(shadow, 5, 4, 1)


def test_periodic_tail_drafts_a_loop_at_full_length():
    assert ngram_propose([5, 1, 2, 1, 2], 5, max_n=2) == [1, 2, 1, 2, 1]
    assert ngram_propose([3, 3, 3], 4) == [3, 3, 3, 3]


def test_bad_n_range_is_refused():
    with pytest.raises(ValueError):
        NgramIndex(max_n=2, min_n=3)
    with pytest.raises(ValueError):
        NgramIndex(max_n=2, min_n=0)


def test_engine_rolls_the_index_back_with_the_sequence():
    engine = DraftEngine(NgramDrafter(max_n=3, min_n=1))
    prompt = [1, 2, 3, 4, 9, 1, 2, 3]
    assert [p.token for p in engine.propose(ProposeCall("s", 0, prompt, 4))] == [4, 9, 1, 2]
    # The target accepted 1 draft token (4) and corrected the next to 7: known_len = 9, append [7].
    got = [p.token for p in engine.propose(ProposeCall("s", 9, [7], 4))]
    assert got == brute_force(prompt + [4, 7], 4, 3, 1)
    seq = engine.store._sequences["s"]
    assert seq.cache.tokens == prompt + [4, 7]  # the index holds the canonical tokens, no draft tokens
    # A restart of the sequence from scratch re-indexes from nothing.
    assert [p.token for p in engine.propose(ProposeCall("s", 0, [8, 8], 4))] == [8, 8, 8, 8]



def test_calibration_starts_at_the_prior_and_learns_each_match_length_apart():
    cal = MatchCalibration(max_n=4)
    assert cal.survival(4, 3) == pytest.approx([0.85, 0.85 * 0.9, 0.85 * 0.9 ** 2])
    assert cal.survival(1, 1)[0] == pytest.approx(0.2)
    for _ in range(40):
        cal.observe(1, [5, 6], [7, 6])  # 1-token matches: wrong at once
        cal.observe(4, [1, 2, 3], [1, 2, 3, 4])  # 4-token matches: right all along
    assert cal.survival(1, 1)[0] < 0.05
    assert cal.survival(4, 3)[2] > 0.9
    # A miss ends the count: tokens after it are not trials (Kaplan-Meier), nor are unknown ones.
    cal = MatchCalibration(max_n=2, prior_weight=0.0 + 1e-9)
    cal.observe(2, [1, 2, 3], [1, 9, 3])
    cal.observe(2, [1, 2, 3], [1])  # the truth is known for one token only
    assert cal._trials[2][:3] == pytest.approx([2, 1, 0], abs=1e-6)
    assert cal._hits[2][:2] == pytest.approx([2, 0], abs=1e-6)


def test_engine_learns_from_what_the_sequence_turned_out_to_be():
    drafter = NgramDrafter(max_n=3, min_n=1)
    engine = DraftEngine(drafter)
    prompt = [1, 2, 3, 4, 9, 1, 2, 3]
    proposals = list(engine.propose(ProposeCall("s", 0, prompt, 4)))
    assert [p.token for p in proposals] == [4, 9, 1, 2]
    assert [p.cumulative_prob for p in proposals] == pytest.approx(drafter.calibration.survival(3, 4))
    before = list(drafter.calibration._trials[3][:3]), list(drafter.calibration._hits[3][:3])
    # 4 accepted, then 7 instead of 9: one hit at k=1, one miss at k=2, nothing counted after
    list(engine.propose(ProposeCall("s", 9, [7], 4)))
    trials, hits = drafter.calibration._trials[3], drafter.calibration._hits[3]
    assert [t - b for t, b in zip(trials[:3], before[0])] == [1, 1, 0]
    assert [h - b for h, b in zip(hits[:3], before[1])] == [1, 0, 0]
