from draft_service.ngram import ngram_propose


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
