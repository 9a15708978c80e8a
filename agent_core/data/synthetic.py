"""The built-in synthetic 2-hop QA task: a made-up world of films, people, cities and countries.

Everything follows from `random.Random(seed)`, so the same arguments give the same prompts and
documents in the same order on any machine. The world:

- each film has a year and a director (a person);
- each person has a birth city and, for about MARRIED_FRACTION of them, a spouse (symmetric);
- each city lies in a country.

One short document per entity states its facts ("Varo Kelmin is a 1987 film directed by Tessa
Dunmar."). Every question is 2-hop: its first supporting document names the bridge entity, whose
own document (the second) states the answer. Names are built from a small, regular syllable
inventory, every name word is unique in the world, and no name word is an English word used in
the templates, so a tiny tokenizer trained on this text stays small and a search for a name finds
exactly that entity.

Split (a difference from a plain random split, following the measured caveat in ENVIRONMENT.md:
a random split let the policy score by recalling people seen in training): questions are grouped
by their key person (the director for film questions, the person asked about otherwise) and whole
groups go to one split, filled greedily to the requested sizes. A test question's key person is
therefore never the key person of a training question; split sizes can fall short of the target by
less than one group. Cities and countries are shared by all splits (the tiny world has few).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from agent_core.types import ChatMessage, Document, Prompt

# Bump when the generated text changes, so a new generator never reuses an old dataset folder.
GENERATOR_VERSION = 2  # 2: the system prompt leaves tool syntax to the env's tool-call format
MARRIED_FRACTION = 0.6
FIRST_FILM_YEAR, LAST_FILM_YEAR = 1950, 2020

# How to call the search tool is the env's tool-call format's to say (tag or hermes), not the data's.
SYSTEM_PROMPT = "Answer the question. Search as often as you need before answering."

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "l", "s")
_CITY_SUFFIXES = ("port", "ford", "ton", "dale")
_COUNTRY_SUFFIXES = ("land", "ia", "mark")
_ATTEMPTS_PER_LENGTH = 200

# Question templates: name -> text with one slot. The answers of each are built in _questions().
TEMPLATES = {
    "director_birthplace": "Where was the director of {film} born?",
    "director_spouse": "Who is the spouse of the director of {film}?",
    "person_country": "In which country was {person} born?",
    "spouse_birthplace": "Where was the spouse of {person} born?",
}
_TEMPLATE_WORDS = frozenset(
    word.strip("?.,").lower()
    for text in (*TEMPLATES.values(), SYSTEM_PROMPT, "is a film directed by was born in is married to is a city in is a country")
    for word in text.split()
)


@dataclass(frozen=True)
class SyntheticQA:
    """The generated task: prompts (all splits, in id order), the corpus, and its dataset id."""

    prompts: tuple[Prompt, ...]
    documents: tuple[Document, ...]
    dataset_id: str


@dataclass(frozen=True)
class _Film:
    name: str
    year: int
    director: int  # index into people


@dataclass(frozen=True)
class _Person:
    name: str
    city: int  # index into cities
    spouse: int | None  # index into people


@dataclass(frozen=True)
class _City:
    name: str
    country: int  # index into countries


@dataclass(frozen=True)
class _World:
    films: tuple[_Film, ...]
    people: tuple[_Person, ...]
    cities: tuple[_City, ...]
    countries: tuple[str, ...]


@dataclass(frozen=True)
class _Question:
    template: str
    text: str
    answer: str
    supporting_doc_ids: tuple[str, str]  # (names the bridge entity, states the answer)
    key_person: int  # the person whose facts the question hinges on; splits never share one


class _NameMaker:
    """Pronounceable made-up words, each unique in the world (case-insensitively)."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._used: set[str] = set(_TEMPLATE_WORDS)

    def word(self, syllables: int, suffixes: tuple[str, ...] = ("",)) -> str:
        # Grow the word when short ones run out, so large worlds still terminate.
        for length in range(syllables, syllables + 4):
            for _ in range(_ATTEMPTS_PER_LENGTH):
                candidate = "".join(self._syllable() for _ in range(length)) + self._rng.choice(suffixes)
                if candidate not in self._used:
                    self._used.add(candidate)
                    return candidate.capitalize()
        raise ValueError(f"could not make {len(self._used)}+ unique names; ask for a smaller world")

    def _syllable(self) -> str:
        return self._rng.choice(_ONSETS) + self._rng.choice(_VOWELS) + self._rng.choice(_CODAS)


def _marry(rng: random.Random, birth_cities: list[int], num_pairs: int) -> dict[int, int]:
    """Person -> spouse, symmetric. Spouses are born in different cities, so the person's own
    document never already contains the answer to "Where was the spouse of {person} born?"."""
    single = list(range(len(birth_cities)))
    rng.shuffle(single)
    spouses: dict[int, int] = {}
    while single and len(spouses) < 2 * num_pairs:
        a = single.pop()
        partner = next((b for b in reversed(single) if birth_cities[b] != birth_cities[a]), None)
        if partner is not None:
            single.remove(partner)
            spouses[a], spouses[partner] = partner, a
    return spouses


def _build_world(rng: random.Random, num_films: int, num_people: int, num_cities: int, num_countries: int) -> _World:
    names = _NameMaker(rng)
    countries = tuple(names.word(1, _COUNTRY_SUFFIXES) for _ in range(num_countries))
    cities = tuple(_City(names.word(1, _CITY_SUFFIXES), rng.randrange(num_countries)) for _ in range(num_cities))
    person_names = [f"{names.word(2)} {names.word(2)}" for _ in range(num_people)]
    birth_cities = [rng.randrange(num_cities) for _ in range(num_people)]
    spouses = _marry(rng, birth_cities, num_pairs=int(num_people * MARRIED_FRACTION) // 2)
    people = tuple(
        _Person(name, birth_cities[i], spouses.get(i)) for i, name in enumerate(person_names)
    )
    films = tuple(
        _Film(f"{names.word(2)} {names.word(2)}", rng.randint(FIRST_FILM_YEAR, LAST_FILM_YEAR), rng.randrange(num_people))
        for _ in range(num_films)
    )
    return _World(films=films, people=people, cities=cities, countries=countries)


def _doc_id(kind: str, index: int) -> str:
    return f"{kind}-{index:04d}"


def _documents(world: _World) -> tuple[Document, ...]:
    docs = [
        Document(_doc_id("film", i), f.name, f"{f.name} is a {f.year} film directed by {world.people[f.director].name}.")
        for i, f in enumerate(world.films)
    ]
    for i, person in enumerate(world.people):
        text = f"{person.name} was born in {world.cities[person.city].name}."
        if person.spouse is not None:
            text += f" {person.name} is married to {world.people[person.spouse].name}."
        docs.append(Document(_doc_id("person", i), person.name, text))
    docs += [
        Document(_doc_id("city", i), c.name, f"{c.name} is a city in {world.countries[c.country]}.")
        for i, c in enumerate(world.cities)
    ]
    docs += [Document(_doc_id("country", i), name, f"{name} is a country.") for i, name in enumerate(world.countries)]
    return tuple(docs)


def _questions(world: _World) -> list[_Question]:
    people, cities = world.people, world.cities
    questions = []
    for i, film in enumerate(world.films):
        director = people[film.director]
        docs = (_doc_id("film", i), _doc_id("person", film.director))
        text = TEMPLATES["director_birthplace"].format(film=film.name)
        questions.append(_Question("director_birthplace", text, cities[director.city].name, docs, film.director))
        if director.spouse is not None:
            text = TEMPLATES["director_spouse"].format(film=film.name)
            questions.append(_Question("director_spouse", text, people[director.spouse].name, docs, film.director))
    for i, person in enumerate(people):
        docs = (_doc_id("person", i), _doc_id("city", person.city))
        text = TEMPLATES["person_country"].format(person=person.name)
        questions.append(_Question("person_country", text, world.countries[cities[person.city].country], docs, i))
        if person.spouse is not None:
            spouse = people[person.spouse]
            docs = (_doc_id("person", i), _doc_id("person", person.spouse))
            text = TEMPLATES["spouse_birthplace"].format(person=person.name)
            questions.append(_Question("spouse_birthplace", text, cities[spouse.city].name, docs, i))
    return questions


def _assign_splits(questions: list[_Question], rng: random.Random, dev_fraction: float, test_fraction: float) -> list[str]:
    """One split per question; all questions of a key person share it (see the module docstring)."""
    groups: dict[int, list[int]] = {}
    for index, question in enumerate(questions):
        groups.setdefault(question.key_person, []).append(index)
    keys = list(groups)
    rng.shuffle(keys)
    targets = {"test": round(len(questions) * test_fraction), "dev": round(len(questions) * dev_fraction)}
    filled = {"test": 0, "dev": 0}
    splits = ["train"] * len(questions)
    for key in keys:
        members = groups[key]
        for split in ("test", "dev"):
            if filled[split] + len(members) <= targets[split]:
                filled[split] += len(members)
                for index in members:
                    splits[index] = split
                break
    return splits


def _dataset_id(arguments: dict[str, float | int]) -> str:
    digest = hashlib.sha256(json.dumps({**arguments, "version": GENERATOR_VERSION}, sort_keys=True).encode())
    a = arguments
    return (
        f"synthetic-s{a['seed']}-f{a['num_films']}-p{a['num_people']}-c{a['num_cities']}"
        f"-n{a['num_countries']}-{digest.hexdigest()[:8]}"
    )


def _check_arguments(arguments: dict[str, float | int]) -> None:
    minimums = {"num_films": 1, "num_people": 2, "num_cities": 1, "num_countries": 1, "top_k": 1}
    for name, minimum in minimums.items():
        if not isinstance(arguments[name], int) or arguments[name] < minimum:
            raise ValueError(f"generate_synthetic_qa: {name} must be an integer >= {minimum}, got {arguments[name]!r}")
    for name in ("dev_fraction", "test_fraction"):
        if not 0 <= arguments[name] < 1:
            raise ValueError(f"generate_synthetic_qa: {name} must be in [0, 1), got {arguments[name]!r}")
    if arguments["dev_fraction"] + arguments["test_fraction"] >= 1:
        raise ValueError("generate_synthetic_qa: dev_fraction + test_fraction must be < 1 (leave some training data)")


def generate_synthetic_qa(
    seed: int,
    num_films: int = 200,
    num_people: int = 120,
    num_cities: int = 40,
    num_countries: int = 12,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
    top_k: int = 3,
) -> SyntheticQA:
    """Generate the task. Same arguments -> identical output (prompts, documents, order, ids)."""
    arguments = dict(
        seed=seed, num_films=num_films, num_people=num_people, num_cities=num_cities,
        num_countries=num_countries, dev_fraction=dev_fraction, test_fraction=test_fraction, top_k=top_k,
    )
    _check_arguments(arguments)
    rng = random.Random(seed)
    world = _build_world(rng, num_films, num_people, num_cities, num_countries)
    questions = _questions(world)
    rng.shuffle(questions)
    splits = _assign_splits(questions, rng, dev_fraction, test_fraction)
    prompts = tuple(
        Prompt(
            prompt_id=f"synth-{seed}-{n}",
            data_source="synthetic",
            split=split,
            messages=(ChatMessage("system", SYSTEM_PROMPT), ChatMessage("user", f"Question: {question.text}")),
            answers=(question.answer,),
            env_name="search_qa",
            env_kwargs={"top_k": top_k},
            metadata={"hops": 2, "template": question.template, "supporting_doc_ids": list(question.supporting_doc_ids)},
        )
        for n, (question, split) in enumerate(zip(questions, splits))
    )
    return SyntheticQA(prompts=prompts, documents=_documents(world), dataset_id=_dataset_id(arguments))
