"""pass@k, maj@k, the paired bootstrap and the vote key against hand-computed values."""

from __future__ import annotations

from math import comb

import pytest

from hpcrl.algo.passk import maj_at_k, majority_score, paired_bootstrap, pass_at_k, vote_key


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 1 / 4),  # pass@1 is the fraction correct
        (4, 1, 2, 1 - 3 / 6),  # C(3,2)/C(4,2): both draws miss the one correct sample
        (4, 2, 2, 1 - 1 / 6),  # C(2,2)/C(4,2)
        (5, 2, 3, 1 - 1 / 10),  # C(3,3)/C(5,3)
        (4, 1, 4, 1.0),  # k = n: any correct sample is drawn
        (4, 0, 4, 0.0),  # k = n, none correct
        (8, 0, 3, 0.0),  # c = 0
        (8, 8, 3, 1.0),  # c = n: all correct
        (8, 6, 3, 1.0),  # n - c < k: every draw holds a correct one
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_product_form_matches_binomials_and_stays_finite_for_large_n():
    assert pass_at_k(200, 13, 50) == pytest.approx(1 - comb(187, 50) / comb(200, 50), rel=1e-12)
    # C(2000, 1000) has ~600 digits (a float overflows); the product form does not care
    value = pass_at_k(2000, 3, 1000)
    assert value == pytest.approx(1 - (1000 * 999 * 998) / (2000 * 1999 * 1998), rel=1e-9)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 0), (4, 1, 5), (4, 5, 2), (4, -1, 2)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_majority_vote_plain_and_ties_split_the_credit():
    # "2" wins 2 votes to 1
    assert majority_score(["2", "3", "2"], [True, False, True]) == 1.0
    assert majority_score(["2", "3", "3"], [True, False, False]) == 0.0
    # 2-2 tie between a right and a wrong answer: half the credit, whatever the order
    assert majority_score(["2", "3", "3", "2"], [True, False, False, True]) == 0.5
    assert majority_score(["3", "2", "2", "3"], [False, True, True, False]) == 0.5
    # three-way tie, one right: a third
    assert majority_score(["1", "2", "3"], [False, True, False]) == pytest.approx(1 / 3)
    # unparsed samples do not vote: the single parsed answer wins
    assert majority_score([None, None, "7"], [False, False, True]) == 1.0
    assert majority_score([None, None], [False, False]) == 0.0
    # an answer is correct if any of its samples verified (one of them timed out)
    assert majority_score(["5", "5", "4"], [False, True, False]) == 1.0


def test_maj_at_k_averages_disjoint_blocks():
    answers = ["1", "1", "2", "2", "2", "1"]
    correct = [a == "1" for a in answers]
    assert maj_at_k(answers, correct, 6) == 0.5  # 3-3 tie over all six
    assert maj_at_k(answers, correct, 3) == 0.5  # block "1,1,2" right, block "2,2,1" wrong
    assert maj_at_k(answers, correct, 2) == pytest.approx((1 + 0 + 0.5) / 3)  # 11, 22, 21 (tie)
    assert maj_at_k(answers, correct, 1) == pytest.approx(3 / 6)
    assert maj_at_k(answers, correct, 4) == 0.5  # one block (1,1,2,2), the rest left out
    with pytest.raises(ValueError):
        maj_at_k(answers, correct, 7)


def test_paired_bootstrap_interval():
    # every problem gains exactly 1: no spread, the interval is the point
    same = paired_bootstrap([0.0] * 20, [1.0] * 20, resamples=500)
    assert (same.delta, same.low, same.high, same.improved, same.worsened) == (1.0, 1.0, 1.0, 20, 0)
    # 30 fixed, 10 broken, 60 unchanged of 100: delta 0.2; the paired standard error is
    # sqrt((0.4 - 0.04) / 100) = 0.06, so the 95% interval is about 0.2 +- 0.118
    before = [0.0] * 30 + [1.0] * 10 + [1.0] * 30 + [0.0] * 30
    after = [1.0] * 30 + [0.0] * 10 + [1.0] * 30 + [0.0] * 30
    d = paired_bootstrap(before, after, resamples=20_000, seed=1)
    assert (d.before, d.after, d.improved, d.worsened) == (0.4, 0.6, 30, 10)
    assert d.delta == pytest.approx(0.2)
    assert d.low == pytest.approx(0.2 - 0.118, abs=0.02) and d.high == pytest.approx(0.2 + 0.118, abs=0.02)
    assert paired_bootstrap(before, after, resamples=2000, seed=3) == paired_bootstrap(
        before, after, resamples=2000, seed=3
    )  # seeded: the same interval every time
    with pytest.raises(ValueError, match="equal, non-zero"):
        paired_bootstrap([1.0], [1.0, 0.0])


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("so \\boxed{\\frac{1}{2}} and finally \\boxed{ \\dfrac{1}{2} }.", "\\frac{1}{2}"),
        ("x = \\boxed{3}.", "3"),
        ("cut off \\boxed{3", "3"),  # an unclosed box falls back to the last number
        ("Work...\nAnswer: 42.\n", "42"),
        ("7+5=12", "12"),
        ("no idea", None),
        ("", None),
    ],
)
def test_vote_key(text, key):
    assert vote_key(text) == key
