"""The synthetic 2-hop QA generator: determinism, answerability from exactly its two documents,
and fair, sized splits. Answers are checked against a reference solver that reads the facts back
out of the document text, so a question whose answer does not follow from the corpus fails."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import pytest

from agent_core.data.synthetic import SYSTEM_PROMPT, TEMPLATES, generate_synthetic_qa
from agent_core.types import Document


@pytest.fixture(scope="module")
def task():
    return generate_synthetic_qa(seed=0)


@dataclass
class Facts:
    director: dict[str, str]
    birth_city: dict[str, str]
    spouse: dict[str, str]
    country: dict[str, str]


def _set_once(mapping: dict[str, str], key: str, value: str) -> None:
    assert mapping.setdefault(key, value) == value, f"{key!r} has two values"


def read_facts(documents: tuple[Document, ...]) -> Facts:
    """Parse every fact back out of the corpus text (independently of the generator's structures)."""
    facts = Facts({}, {}, {}, {})
    for doc in documents:
        for sentence in re.findall(r"[^.]+\.", doc.text):
            sentence = sentence.strip()
            if m := re.fullmatch(r"(.+) is a \d{4} film directed by (.+)\.", sentence):
                _set_once(facts.director, m[1], m[2])
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


_QUESTION_PATTERNS = {name: re.compile(re.escape(text).replace(r"\{film\}", "(.+)").replace(r"\{person\}", "(.+)"))
                      for name, text in TEMPLATES.items()}


def solve(question: str, template: str, facts: Facts) -> tuple[str, str, str]:
    """(entity asked about, bridge entity, answer) by the template's two hops."""
    entity = _QUESTION_PATTERNS[template].fullmatch(question)[1]
    if template == "director_birthplace":
        bridge = facts.director[entity]
        return entity, bridge, facts.birth_city[bridge]
    if template == "director_spouse":
        bridge = facts.director[entity]
        return entity, bridge, facts.spouse[bridge]
    if template == "person_country":
        bridge = facts.birth_city[entity]
        return entity, bridge, facts.country[bridge]
    bridge = facts.spouse[entity]
    return entity, bridge, facts.birth_city[bridge]


def key_person(question: str, template: str, facts: Facts) -> str:
    entity = _QUESTION_PATTERNS[template].fullmatch(question)[1]
    return facts.director[entity] if template.startswith("director") else entity


def test_same_seed_same_output_other_seed_different():
    first, again = generate_synthetic_qa(seed=3), generate_synthetic_qa(seed=3)
    assert first == again
    assert [p.prompt_id for p in first.prompts] == [p.prompt_id for p in again.prompts]
    other = generate_synthetic_qa(seed=4)
    assert other.dataset_id != first.dataset_id
    assert {d.title for d in other.documents} != {d.title for d in first.documents}
    assert [p.answers for p in other.prompts] != [p.answers for p in first.prompts]


def test_dataset_id_encodes_every_argument():
    base = generate_synthetic_qa(seed=0, num_films=20, num_people=12, num_cities=5, num_countries=3)
    assert base.dataset_id.startswith("synthetic-s0-f20-p12-c5-n3-")
    variants = [
        dict(num_films=21), dict(num_people=13), dict(num_cities=6), dict(num_countries=4),
        dict(dev_fraction=0.2), dict(test_fraction=0.2), dict(top_k=5),
    ]
    ids = {base.dataset_id}
    for change in variants:
        args = dict(seed=0, num_films=20, num_people=12, num_cities=5, num_countries=3) | change
        ids.add(generate_synthetic_qa(**args).dataset_id)
    assert len(ids) == len(variants) + 1


def test_prompt_fields(task):
    assert len(task.prompts) > 400  # 200 films + 120 people, plus spouse questions
    for n, prompt in enumerate(task.prompts):
        assert prompt.prompt_id == f"synth-0-{n}"
        assert prompt.data_source == "synthetic"
        assert [m.role for m in prompt.messages] == ["system", "user"]
        assert prompt.messages[0].content == SYSTEM_PROMPT
        assert prompt.messages[1].content.startswith("Question: ")
        assert len(prompt.answers) == 1 and prompt.answers[0]
        assert prompt.env_name == "search_qa" and prompt.env_kwargs == {"top_k": 3}
        assert prompt.metadata["hops"] == 2 and prompt.metadata["template"] in TEMPLATES
    assert set(Counter(p.metadata["template"] for p in task.prompts)) == set(TEMPLATES)


def test_names_are_unique_and_people_have_two_names(task):
    titles = [d.title for d in task.documents]
    assert len(set(titles)) == len(titles) == 200 + 120 + 40 + 12
    assert len({d.doc_id for d in task.documents}) == len(titles)
    words = [w.lower() for t in titles for w in t.split()]
    assert len(set(words)) == len(words)  # no name word is shared by two entities
    people = [d for d in task.documents if d.doc_id.startswith("person-")]
    assert all(len(d.title.split()) == 2 for d in people)


@pytest.mark.parametrize("seed", [0, 7])
def test_every_question_follows_from_its_two_supporting_documents(seed):
    task = generate_synthetic_qa(seed=seed)
    facts = read_facts(task.documents)
    assert all(facts.spouse[facts.spouse[person]] == person for person in facts.spouse)
    by_id = {d.doc_id: d for d in task.documents}
    for prompt in task.prompts:
        question = prompt.messages[1].content.removeprefix("Question: ")
        entity, bridge, answer = solve(question, prompt.metadata["template"], facts)
        assert prompt.answers == (answer,)
        first, second = (by_id[i] for i in prompt.metadata["supporting_doc_ids"])
        assert first.title == entity and entity in question
        assert bridge in first.text and second.title == bridge
        assert answer in second.text
        assert answer not in first.text  # one document alone does not answer it


def test_splits_are_disjoint_sized_and_share_no_key_person(task):
    facts = read_facts(task.documents)
    by_split: dict[str, list] = {"train": [], "dev": [], "test": []}
    for prompt in task.prompts:
        by_split[prompt.split].append(prompt)
    assert sum(map(len, by_split.values())) == len(task.prompts)
    keys = {
        split: {key_person(p.messages[1].content.removeprefix("Question: "), p.metadata["template"], facts) for p in ps}
        for split, ps in by_split.items()
    }
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["dev"] and not keys["dev"] & keys["test"]
    largest_group = max(Counter(
        key_person(p.messages[1].content.removeprefix("Question: "), p.metadata["template"], facts) for p in task.prompts
    ).values())
    target = round(0.1 * len(task.prompts))
    for split in ("dev", "test"):
        assert target - largest_group < len(by_split[split]) <= target


def test_no_held_out_splits_when_fractions_are_zero():
    task = generate_synthetic_qa(seed=1, num_films=8, num_people=6, dev_fraction=0.0, test_fraction=0.0)
    assert {p.split for p in task.prompts} == {"train"}


@pytest.mark.parametrize(
    "change, name",
    [(dict(num_people=1), "num_people"), (dict(test_fraction=1.0), "test_fraction"),
     (dict(dev_fraction=0.5, test_fraction=0.5), "dev_fraction + test_fraction"), (dict(top_k=0), "top_k")],
)
def test_bad_arguments_name_the_argument(change, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        generate_synthetic_qa(seed=0, **change)
