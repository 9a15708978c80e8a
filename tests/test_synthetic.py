"""The synthetic multi-hop QA generator: determinism, answerability of every question type from exactly
its supporting documents, namesake distractors, and splits that share no key entity. Answers are
checked against a reference solver that reads the facts back out of the document text, so a
question whose answer does not follow from the corpus fails."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import pytest

from agent_core.data.synthetic import SYSTEM_PROMPT, TEMPLATES, generate_synthetic_qa
from agent_core.envs.search import Bm25Index
from agent_core.types import Document


@pytest.fixture(scope="module")
def task():
    return generate_synthetic_qa(seed=0)


@dataclass
class Facts:
    director: dict[str, str]
    year: dict[str, int]
    birth_city: dict[str, str]
    spouse: dict[str, str]
    country: dict[str, str]


def _set_once(mapping: dict, key: str, value) -> None:
    assert mapping.setdefault(key, value) == value, f"{key!r} has two values"


def read_facts(documents: tuple[Document, ...]) -> Facts:
    """Parse every fact back out of the corpus text (independently of the generator's structures)."""
    facts = Facts({}, {}, {}, {}, {})
    for doc in documents:
        for sentence in re.findall(r"[^.]+\.", doc.text):
            sentence = sentence.strip()
            if m := re.fullmatch(r"(.+) is a (\d{4}) film directed by (.+)\.", sentence):
                _set_once(facts.director, m[1], m[3])
                _set_once(facts.year, m[1], int(m[2]))
            elif m := re.fullmatch(r"(.+) was born in (.+)\.", sentence):
                _set_once(facts.birth_city, m[1], m[2])
            elif m := re.fullmatch(r"(.+) is married to (.+)\.", sentence):
                _set_once(facts.spouse, m[1], m[2])
            elif m := re.fullmatch(r"(.+) is a city in (.+)\.", sentence):
                _set_once(facts.country, m[1], m[2])
            else:
                assert re.fullmatch(r"(.+) is a country\.", sentence), sentence
            assert sentence.startswith(doc.title), (doc.title, sentence)
    return facts


_PATTERNS = {
    name: re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>.+)", re.escape(template.text)))
    for name, template in TEMPLATES.items()
}


def slots(prompt) -> dict[str, str]:
    return _PATTERNS[prompt.metadata["template"]].fullmatch(prompt.messages[1].content.removeprefix("Question: ")).groupdict()


def solve(template: str, slot: dict[str, str], facts: Facts) -> tuple[list[str], str]:
    """(the titles of the pages to read, in order; the answer), by the template's hops."""
    f = facts
    if template == "film_earlier":
        a, b = slot["film_a"], slot["film_b"]
        assert f.year[a] != f.year[b]
        return [a, b], a if f.year[a] < f.year[b] else b
    if template == "directors_same_city":
        a, b = slot["film_a"], slot["film_b"]
        da, db = f.director[a], f.director[b]
        assert da != db
        return [a, b, da, db], "yes" if f.birth_city[da] == f.birth_city[db] else "no"
    entity = slot.get("film") or slot["person"]
    chain = [entity]
    steps = {
        "director_birthplace": [f.director, f.birth_city], "director_spouse": [f.director, f.spouse],
        "person_country": [f.birth_city, f.country], "spouse_birthplace": [f.spouse, f.birth_city],
        "director_country": [f.director, f.birth_city, f.country],
        "director_spouse_birthplace": [f.director, f.spouse, f.birth_city],
        "spouse_country": [f.spouse, f.birth_city, f.country],
    }[template]
    for relation in steps:
        chain.append(relation[chain[-1]])
    return chain[:-1], chain[-1]


def key_people(prompt, facts: Facts) -> set[str]:
    slot = slots(prompt)
    films = [slot[k] for k in ("film", "film_a", "film_b") if k in slot]
    return {facts.director[film] for film in films} | ({slot["person"]} if "person" in slot else set())


def test_same_seed_same_output_other_seed_different():
    first, again = generate_synthetic_qa(seed=3), generate_synthetic_qa(seed=3)
    assert first == again
    assert [p.metadata for p in first.prompts] == [p.metadata for p in again.prompts]
    other = generate_synthetic_qa(seed=4)
    assert other.dataset_id != first.dataset_id
    assert {d.title for d in other.documents} != {d.title for d in first.documents}
    assert [p.answers for p in other.prompts] != [p.answers for p in first.prompts]


def test_dataset_id_encodes_every_argument():
    base_args = dict(seed=0, num_films=20, num_people=12, num_cities=5, num_countries=3)
    base = generate_synthetic_qa(**base_args)
    assert base.dataset_id.startswith("synthetic-s0-f20-p12-c5-n3-")
    variants = [
        dict(num_films=21), dict(num_people=13), dict(num_cities=6), dict(num_countries=4),
        dict(dev_fraction=0.2), dict(test_fraction=0.2), dict(top_k=5), dict(three_hop_fraction=0.1),
        dict(comparison_fraction=0.1), dict(distractor_fraction=0.5),
    ]
    ids = {base.dataset_id} | {generate_synthetic_qa(**(base_args | change)).dataset_id for change in variants}
    assert len(ids) == len(variants) + 1


def test_prompt_fields_and_question_mix(task):
    assert len(task.prompts) > 800
    titles = {d.doc_id: d.title for d in task.documents}
    for n, prompt in enumerate(task.prompts):
        assert prompt.prompt_id == f"synth-0-{n}" and prompt.data_source == "synthetic"
        assert [m.role for m in prompt.messages] == ["system", "user"] and prompt.messages[0].content == SYSTEM_PROMPT
        assert prompt.messages[1].content.startswith("Question: ")
        assert len(prompt.answers) == 1 and prompt.answers[0]
        assert prompt.env_name == "search_qa" and prompt.env_kwargs == {"top_k": 3}
        meta, template = prompt.metadata, TEMPLATES[prompt.metadata["template"]]
        assert (meta["hops"], meta["type"]) == (template.hops, template.type)
        assert meta["oracle_plan"] == {"queries": [titles[i] for i in meta["supporting_doc_ids"]], "answer": prompt.answers[0]}
    counts = Counter(p.metadata["template"] for p in task.prompts)
    assert set(counts) == set(TEMPLATES)
    share = {kind: sum(n for t, n in counts.items() if check(TEMPLATES[t])) / len(task.prompts) for kind, check in
             {"3-hop bridge": lambda t: t.type == "bridge" and t.hops == 3, "comparison": lambda t: t.type == "comparison"}.items()}
    assert share["3-hop bridge"] == pytest.approx(0.25, abs=0.02) and share["comparison"] == pytest.approx(0.2, abs=0.02)
    yes_no = Counter(p.answers[0] for p in task.prompts if p.metadata["template"] == "directors_same_city")
    assert set(yes_no) == {"yes", "no"} and abs(yes_no["yes"] - yes_no["no"]) <= 0.2 * sum(yes_no.values())
    assert len({p.messages[1].content for p in task.prompts}) == len(task.prompts)


def test_fractions_zero_give_only_two_hop_bridges():
    task = generate_synthetic_qa(seed=2, num_films=30, num_people=20, three_hop_fraction=0.0, comparison_fraction=0.0)
    assert {(p.metadata["type"], p.metadata["hops"]) for p in task.prompts} == {("bridge", 2)}


_POOLED = dict(num_films=100, num_people=80, num_cities=15, num_countries=5, name_pool=12)


@pytest.mark.parametrize("seed, names", [(0, {}), (7, {}), (3, {**_POOLED, "name_syllables": 1}),
                                         (3, {**_POOLED, "name_syllables": 2})])
def test_every_question_follows_from_its_supporting_documents(seed, names):
    task = generate_synthetic_qa(seed=seed, **names)
    assert {p.metadata["type"] for p in task.prompts} == {"bridge", "comparison"}
    facts = read_facts(task.documents)
    assert all(facts.spouse[facts.spouse[person]] == person for person in facts.spouse)
    by_id = {d.doc_id: d for d in task.documents}
    for prompt in task.prompts:
        pages, answer = solve(prompt.metadata["template"], slots(prompt), facts)
        assert prompt.answers == (answer,), prompt
        supporting = [by_id[i] for i in prompt.metadata["supporting_doc_ids"]]
        assert [d.title for d in supporting] == pages
        if prompt.metadata["type"] == "bridge":
            assert len(supporting) == prompt.metadata["hops"]
            for page, following in zip(supporting, supporting[1:]):
                assert following.title in page.text  # each page names the next one
            assert answer in supporting[-1].text
            assert not any(answer in page.text for page in supporting[:-1])  # no shortcut


def test_namesakes_share_a_name_word_and_full_names_find_their_own_page_in_top_3(task):
    titles = [d.title for d in task.documents]
    assert len(set(titles)) == len(titles) == 200 + 120 + 40 + 12
    people = [d.title.split() for d in task.documents if d.doc_id.startswith("person-")]
    films = [d.title.split() for d in task.documents if d.doc_id.startswith("film-")]
    assert all(len(name) == 2 for name in people)
    first_names, surnames = Counter(n[0] for n in people), Counter(n[1] for n in people)
    assert sum(c > 1 for c in first_names.values()) >= 5 and sum(c > 1 for c in surnames.values()) >= 5
    assert sum(bool(set(film) & set(surnames)) for film in films) >= 20  # film titles holding a surname
    index = Bm25Index(task.documents)
    wrong_on_part = 0
    for doc in task.documents:
        assert doc in index.search(doc.title, top_k=3), doc.title
        if doc.doc_id.startswith("person-"):
            wrong_on_part += index.search(doc.title.split()[1], top_k=1)[0] != doc
    assert wrong_on_part >= 10  # a surname alone often finds another entity first


def test_without_distractors_every_name_word_is_unique():
    task = generate_synthetic_qa(seed=0, num_films=40, num_people=30, distractor_fraction=0.0)
    words = [w.lower() for d in task.documents for w in d.title.split()]
    assert len(set(words)) == len(words)


def test_splits_share_no_key_entity_and_are_sized(task):
    facts = read_facts(task.documents)
    by_split: dict[str, list] = {"train": [], "dev": [], "test": []}
    for prompt in task.prompts:
        by_split[prompt.split].append(prompt)
    assert sum(map(len, by_split.values())) == len(task.prompts)
    people = {split: set().union(*(key_people(p, facts) for p in ps)) for split, ps in by_split.items()}
    named = {split: {name for p in ps for name in slots(p).values()} for split, ps in by_split.items()}
    for a, b in (("train", "test"), ("train", "dev"), ("dev", "test")):
        assert not people[a] & people[b], (a, b)
        assert not named[a] & named[b], (a, b)  # no held-out question starts from a training entity
    for split in ("dev", "test"):
        assert {p.metadata["type"] for p in by_split[split]} == {"bridge", "comparison"}
        assert len(by_split[split]) == pytest.approx(0.1 * len(task.prompts), rel=0.1)


def test_no_held_out_splits_when_fractions_are_zero():
    task = generate_synthetic_qa(seed=1, num_films=8, num_people=6, dev_fraction=0.0, test_fraction=0.0)
    assert {p.split for p in task.prompts} == {"train"}


@pytest.mark.parametrize(
    "change, name",
    [(dict(num_people=1), "num_people"), (dict(test_fraction=1.0), "test_fraction"),
     (dict(dev_fraction=0.5, test_fraction=0.5), "dev_fraction + test_fraction"), (dict(top_k=0), "top_k"),
     (dict(three_hop_fraction=0.6, comparison_fraction=0.4), "three_hop_fraction + comparison_fraction"),
     (dict(comparison_fraction=-0.1), "comparison_fraction"), (dict(distractor_fraction=1.5), "distractor_fraction")],
)
def test_bad_arguments_name_the_argument(change, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        generate_synthetic_qa(seed=0, **change)


def test_split_by_question_holds_out_questions_not_people():
    from agent_core.data.synthetic import generate_synthetic_qa as generate

    strict = generate(seed=3, num_films=60, num_people=40, num_cities=10, num_countries=4)
    by_question = generate(seed=3, num_films=60, num_people=40, num_cities=10, num_countries=4, split_by="question")
    assert by_question.dataset_id != strict.dataset_id
    assert by_question == generate(seed=3, num_films=60, num_people=40, num_cities=10, num_countries=4,
                                   split_by="question")  # deterministic
    counts = {s: sum(p.split == s for p in by_question.prompts) for s in ("train", "dev", "test")}
    total = len(by_question.prompts)
    assert counts["test"] == round(0.1 * total) and counts["dev"] == round(0.1 * total)
    train_questions = {p.messages[-1].content for p in by_question.prompts if p.split == "train"}
    held_out = [p for p in by_question.prompts if p.split != "train"]
    assert not any(p.messages[-1].content in train_questions for p in held_out)  # unseen combinations
    # ... whose supporting pages (entities) training questions do use
    train_docs = {d for p in by_question.prompts if p.split == "train" for d in p.metadata["supporting_doc_ids"]}
    assert sum(bool(set(p.metadata["supporting_doc_ids"]) & train_docs) for p in held_out) > len(held_out) / 2
    with pytest.raises(ValueError, match="split_by must be one of key_people, question"):
        generate(seed=3, split_by="people")
