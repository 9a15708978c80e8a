"""Name styles of the synthetic task (`generate_synthetic_qa(name_syllables=, name_pool=)`, `NameStyle`
in agent_core/data/synthetic_world.py): pooled names are pairs of words from four disjoint pools of
k words (people's first names, people's surnames, films' first words, films' second words, all
made by the one-use-per-word name maker), full names stay unique, the syllable count sets the word
length, the dataset id records only non-default settings, bad values are refused by name, and
every question still follows from its supporting documents (helpers of tests/test_synthetic.py)."""

from __future__ import annotations

import re

import pytest

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.data.synthetic_world import NameStyle
from agent_core.envs.search import Bm25Index

SMALL = dict(seed=0, num_films=40, num_people=30, num_cities=8, num_countries=4)
POOL = 8  # 30 people and 40 films from 8 x 8 = 64 pairs each


def _names(task, kind: str) -> list[list[str]]:
    return [d.title.split() for d in task.documents if d.doc_id.startswith(f"{kind}-")]


def _name_words(task) -> set[str]:
    return {w for kind in ("person", "film") for name in _names(task, kind) for w in name}


@pytest.fixture(scope="module")
def pooled():
    return generate_synthetic_qa(**SMALL, name_pool=POOL)


def test_name_style_defaults_are_the_original_style():
    assert NameStyle() == NameStyle(syllables=2, pool_size=0)


def test_pooled_names_are_unique_pairs_from_four_disjoint_pools_of_k_words(pooled):
    people, films = _names(pooled, "person"), _names(pooled, "film")
    assert len(people) == 30 and len(films) == 40
    assert all(len(name) == 2 for name in people + films)
    titles = [d.title for d in pooled.documents]
    assert len(set(titles)) == len(titles)  # every full name is still unique
    pools = {
        "person first": {n[0] for n in people}, "person surname": {n[1] for n in people},
        "film first": {n[0] for n in films}, "film second": {n[1] for n in films},
    }
    for label, words in pools.items():
        assert len(words) <= POOL, (label, sorted(words))
    labels = list(pools)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            assert not pools[a] & pools[b], (a, b)  # each pool's words are its own
    places = {d.title for d in pooled.documents if d.doc_id.startswith(("city-", "country-"))}
    assert not _name_words(pooled) & places
    assert len(_name_words(pooled)) <= 4 * POOL


def test_without_a_pool_the_same_world_needs_many_more_name_words(pooled):
    unpooled = generate_synthetic_qa(**SMALL)
    # 30 people + 40 films with (mostly) fresh words each: far more than the 4 pools of 8 allow
    assert len(_name_words(unpooled)) > 4 * POOL >= len(_name_words(pooled))


def test_pooled_people_share_first_names():
    task = generate_synthetic_qa(**SMALL, name_pool=POOL)
    firsts = [n[0] for n in _names(task, "person")]
    assert len(set(firsts)) < len(firsts)  # 30 people, at most 8 first names: namesakes by construction


def test_pooled_style_ignores_distractor_fraction():
    a = generate_synthetic_qa(**SMALL, name_pool=POOL, distractor_fraction=0.0)
    b = generate_synthetic_qa(**SMALL, name_pool=POOL, distractor_fraction=0.9)
    assert a.documents == b.documents and a.dataset_id != b.dataset_id


def test_a_pool_too_small_for_the_world_is_refused():
    with pytest.raises(ValueError, match="name pool"):
        generate_synthetic_qa(**SMALL, name_pool=5)  # 5 x 5 = 25 pairs < 30 people


@pytest.mark.parametrize("pool", [0, POOL])
def test_name_syllables_set_the_word_length(pool):
    # a syllable is onset (1 letter) + vowel (1) + coda (0 or 1): 2..3 letters
    lengths = {s: {len(w) for w in _name_words(generate_synthetic_qa(**SMALL, name_pool=pool, name_syllables=s))}
               for s in (1, 2, 3)}
    assert max(lengths[1]) <= 3 and min(lengths[1]) >= 2
    assert min(lengths[2]) >= 4 and max(lengths[2]) <= 6
    assert min(lengths[3]) >= 6
    assert max(lengths[1]) < min(lengths[3])


def test_dataset_id_keeps_defaults_out_and_records_other_settings():
    base = generate_synthetic_qa(**SMALL).dataset_id
    assert generate_synthetic_qa(**SMALL, name_syllables=2, name_pool=0).dataset_id == base
    ids = {generate_synthetic_qa(**SMALL, **change).dataset_id
           for change in (dict(name_syllables=1), dict(name_syllables=3), dict(name_pool=POOL),
                          dict(name_pool=POOL, name_syllables=1))}
    assert len(ids) == 4 and base not in ids


def test_same_name_settings_same_output(pooled):
    assert generate_synthetic_qa(**SMALL, name_pool=POOL) == pooled


@pytest.mark.parametrize("change, name", [(dict(name_syllables=0), "name_syllables"),
                                          (dict(name_pool=-1), "name_pool"),
                                          (dict(name_pool=2.5), "name_pool")])
def test_bad_name_settings_name_the_argument(change, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        generate_synthetic_qa(**SMALL, **change)


def test_a_pooled_full_name_finds_its_own_page_in_top_3(pooled):
    index = Bm25Index(pooled.documents)
    for doc in pooled.documents:
        assert doc in index.search(doc.title, top_k=3), doc.title

# Every question still follows from its documents with pooled names: tests/test_synthetic.py
# (test_every_question_follows_from_its_supporting_documents, parametrized over name settings).
