"""QA answer matching and the outcome scorers, against hand-worked values and a plain reference."""

from __future__ import annotations

import random
import re
import string

import pytest

from agent_core.registry import UnknownNameError
from agent_core.rewards.qa import exact_match, f1_score, normalize_answer
from agent_core.rewards.scorers import SCORERS, Score


@pytest.mark.parametrize(
    "raw, normalized",
    [
        ("The Cat!", "cat"),
        ("  A  big,\tdog. ", "big dog"),
        ("an apple-pie", "applepie"),  # punctuation is removed, not replaced by a space
        ("Theater and Anthem", "theater and anthem"),  # articles only as whole words
        ("the", ""),
        ("U.S.A.", "usa"),
        ("Quill-port's ANSWER", "quillports answer"),
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


@pytest.mark.parametrize(
    "prediction, golds, expected",
    [
        ("the Eiffel Tower", ["Eiffel Tower"], 1.0),
        ("Eiffel tower.", ["The Eiffel Tower"], 1.0),
        ("NYC", ["New York City", "NYC"], 1.0),  # an alias matches
        ("New York", ["New York City", "NYC"], 0.0),
        ("", ["Paris"], 0.0),
    ],
)
def test_exact_match(prediction, golds, expected):
    assert exact_match(prediction, golds) == expected


@pytest.mark.parametrize(
    "prediction, golds, expected",
    [
        ("the quick brown fox", ["quick red fox"], 2 / 3),  # P = R = 2/3
        ("fox", ["quick red fox"], 0.5),  # P = 1, R = 1/3 -> 2 * (1/3) / (4/3)
        ("fox fox fox", ["fox"], 0.5),  # overlap counts each gold token once: P = 1/3, R = 1
        ("red fox", ["blue whale", "quick red fox"], 0.8),  # best gold: P = 1, R = 2/3
        ("The Red Fox!", ["red fox"], 1.0),
        ("yes", ["yes sir"], 0.0),  # HotpotQA: yes/no/noanswer get no partial credit
        ("no way", ["no"], 0.0),
        ("Yes.", ["yes"], 1.0),
        ("noanswer", ["noanswer"], 1.0),
        ("", ["Paris"], 0.0),
        ("the", ["a"], 0.0),  # both normalize to nothing: no tokens in common (official rule)
    ],
)
def test_f1_hand_worked(prediction, golds, expected):
    assert f1_score(prediction, golds) == pytest.approx(expected)


def _reference_f1(prediction: str, gold: str) -> float:
    """A deliberately plain re-statement of the HotpotQA rule."""
    def norm(text):
        text = "".join(c for c in text.lower() if c not in string.punctuation)
        return [w for w in text.split() if w not in ("a", "an", "the")]

    p, g = norm(prediction), norm(gold)
    if (" ".join(p) in ("yes", "no", "noanswer") or " ".join(g) in ("yes", "no", "noanswer")) and p != g:
        return 0.0
    remaining, same = list(g), 0
    for token in p:
        if token in remaining:
            remaining.remove(token)
            same += 1
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def test_f1_matches_a_plain_reference_on_random_answers():
    rng = random.Random(0)
    words = ["red", "fox", "The", "a", "an", "yes", "no", "Quill", "port,", "Fox.", "noanswer", "big"]
    for _ in range(2000):
        prediction = " ".join(rng.choices(words, k=rng.randint(0, 5)))
        golds = [" ".join(rng.choices(words, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        expected = max(_reference_f1(prediction, gold) for gold in golds)
        assert f1_score(prediction, golds) == pytest.approx(expected), (prediction, golds)
        if exact_match(prediction, golds) == 1.0 and normalize_answer(prediction):
            assert f1_score(prediction, golds) == 1.0


def test_gold_answers_are_required_as_a_sequence():
    with pytest.raises(ValueError, match="no gold answers"):
        exact_match("x", [])
    with pytest.raises(TypeError, match="not one string"):
        f1_score("x", "x")


# ---- scorers ----------------------------------------------------------------------------------


def test_registered_scorers():
    # the built-ins; a plugin loaded by another test in this process (examples/) may have added more
    builtin = [name for name in SCORERS.names() if name.startswith("qa_")]
    assert builtin == ["qa_em", "qa_f1"]
    with pytest.raises(UnknownNameError, match=re.escape(", ".join(SCORERS.names()))):
        SCORERS.get("qa_exact")


def test_qa_em_scores():
    qa_em = SCORERS.get("qa_em")
    assert qa_em("the Kolton", ["Kolton"], format_weight=0.1) == Score(
        outcome=1.1, em=1.0, f1=1.0, format_score=1.0, components={"em": 1.0, "f1": 1.0, "format": 1.0}
    )
    wrong = qa_em("Tiford", ["Kolton"], format_weight=0.1)
    assert (wrong.outcome, wrong.em, wrong.format_score) == (pytest.approx(0.1), 0.0, 1.0)
    missing = qa_em(None, ["Kolton"], format_weight=0.1)
    assert (missing.outcome, missing.em, missing.f1, missing.format_score) == (0.0, 0.0, 0.0, 0.0)


def test_qa_f1_scores_partial_answers():
    qa_f1 = SCORERS.get("qa_f1")
    partial = qa_f1("Nargol", ["Nargol Voror"], format_weight=0.5)  # P = 1, R = 1/2 -> F1 = 2/3
    assert partial.f1 == pytest.approx(2 / 3) and partial.em == 0.0
    assert partial.outcome == pytest.approx(2 / 3 + 0.5)
    assert partial.components == {"em": 0.0, "f1": pytest.approx(2 / 3), "format": 1.0}
    assert qa_f1(None, ["Nargol Voror"], format_weight=0.5).outcome == 0.0


def test_scorers_reject_prompts_without_answers():
    with pytest.raises(ValueError, match="no gold answers"):
        SCORERS.get("qa_em")(None, [], format_weight=0.0)
