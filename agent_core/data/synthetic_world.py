"""The made-up world behind the built-in synthetic task: films, people, cities, countries, and the one short
document per entity that states its facts.

Films have a year and a director, people a birth city and sometimes a spouse, cities a country. Names come
from a small syllable inventory (`NameStyle`: unique or pooled words), every full name is unique, and a search
on the full name finds the entity's own page in the top 3.
Design notes: docs/architecture.md §11 (agent_core/data/synthetic_world.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Collection

MARRIED_FRACTION = 0.6
FIRST_FILM_YEAR, LAST_FILM_YEAR = 1950, 2020

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "l", "s")
_CITY_SUFFIXES = ("port", "ford", "ton", "dale")
_COUNTRY_SUFFIXES = ("land", "ia", "mark")
_ATTEMPTS_PER_LENGTH = 200


@dataclass(frozen=True)
class Film:
    name: str
    year: int
    director: int  # index into people


@dataclass(frozen=True)
class Person:
    name: str
    city: int  # index into cities
    spouse: int | None  # index into people


@dataclass(frozen=True)
class City:
    name: str
    country: int  # index into countries


@dataclass(frozen=True)
class World:
    films: tuple[Film, ...]
    people: tuple[Person, ...]
    cities: tuple[City, ...]
    countries: tuple[str, ...]


@dataclass(frozen=True)
class DocRef:
    """An entity's own document: its id and its title (the entity's full name)."""

    doc_id: str
    title: str


@dataclass(frozen=True)
class WorldSizes:
    num_films: int
    num_people: int
    num_cities: int
    num_countries: int


@dataclass(frozen=True)
class NameStyle:
    """How people and films are named (module docstring). syllables: per name word.
    pool_size: 0 = every word used once; k = names are pairs of words from pools of k words."""

    syllables: int = 2
    pool_size: int = 0


class _NameMaker:
    """Pronounceable made-up words, each used once in the world (case-insensitively)."""

    def __init__(self, rng: random.Random, reserved_words: Collection[str]):
        self._rng = rng
        self._used: set[str] = {word.lower() for word in reserved_words}

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


def _person_names(rng: random.Random, names: _NameMaker, count: int, distractor_fraction: float,
                  syllables: int) -> list[str]:
    """Two-word names; a namesake keeps an earlier person's first name or surname in its place."""
    person_names: list[str] = []
    for _ in range(count):
        if person_names and rng.random() < distractor_fraction:
            first, surname = rng.choice(person_names).split()
            person_names.append(
                f"{first} {names.word(syllables)}" if rng.random() < 0.5 else f"{names.word(syllables)} {surname}"
            )
        else:
            person_names.append(f"{names.word(syllables)} {names.word(syllables)}")
    return person_names


def _pooled_names(rng: random.Random, pools: tuple[list[str], list[str]], count: int) -> list[str]:
    """`count` distinct "first second" names, each word drawn from its pool."""
    capacity = len(pools[0]) * len(pools[1])
    if count > capacity:
        raise ValueError(f"{count} names cannot be made from word pools of {len(pools[0])} x {len(pools[1])}; "
                         "ask for a smaller world or a larger name pool")
    chosen: set[str] = set()
    names = []
    while len(names) < count:
        name = f"{rng.choice(pools[0])} {rng.choice(pools[1])}"
        if name not in chosen:
            chosen.add(name)
            names.append(name)
    return names


def _word_pools(names: _NameMaker, style: NameStyle) -> tuple[list[str], list[str]]:
    return tuple([names.word(style.syllables) for _ in range(style.pool_size)] for _ in range(2))


def _film_title(rng: random.Random, names: _NameMaker, person_names: list[str], distractor_fraction: float,
                syllables: int) -> str:
    if rng.random() < distractor_fraction:
        surname = rng.choice(person_names).split()[1]
        return f"{surname} {names.word(syllables)}" if rng.random() < 0.5 else f"{names.word(syllables)} {surname}"
    return f"{names.word(syllables)} {names.word(syllables)}"


def build_world(rng: random.Random, sizes: WorldSizes, distractor_fraction: float, reserved_words: Collection[str],
                style: NameStyle = NameStyle()) -> World:
    names = _NameMaker(rng, reserved_words)
    countries = tuple(names.word(1, _COUNTRY_SUFFIXES) for _ in range(sizes.num_countries))
    cities = tuple(
        City(names.word(1, _CITY_SUFFIXES), rng.randrange(sizes.num_countries)) for _ in range(sizes.num_cities)
    )
    pooled_titles: list[str] = []
    if style.pool_size:
        person_names = _pooled_names(rng, _word_pools(names, style), sizes.num_people)
        pooled_titles = _pooled_names(rng, _word_pools(names, style), sizes.num_films)
    else:
        person_names = _person_names(rng, names, sizes.num_people, distractor_fraction, style.syllables)
    birth_cities = [rng.randrange(sizes.num_cities) for _ in range(sizes.num_people)]
    spouses = _marry(rng, birth_cities, num_pairs=int(sizes.num_people * MARRIED_FRACTION) // 2)
    people = tuple(Person(name, birth_cities[i], spouses.get(i)) for i, name in enumerate(person_names))
    films = tuple(
        Film(
            pooled_titles[i] if pooled_titles else _film_title(rng, names, person_names, distractor_fraction,
                                                               style.syllables),
            rng.randint(FIRST_FILM_YEAR, LAST_FILM_YEAR),
            rng.randrange(sizes.num_people),
        )
        for i in range(sizes.num_films)
    )
    return World(films=films, people=people, cities=cities, countries=countries)


def film_doc(world: World, index: int) -> DocRef:
    return DocRef(f"film-{index:04d}", world.films[index].name)


def person_doc(world: World, index: int) -> DocRef:
    return DocRef(f"person-{index:04d}", world.people[index].name)


def city_doc(world: World, index: int) -> DocRef:
    return DocRef(f"city-{index:04d}", world.cities[index].name)


def country_doc(world: World, index: int) -> DocRef:
    return DocRef(f"country-{index:04d}", world.countries[index])


def world_documents(world: World) -> list[tuple[DocRef, str]]:
    """(document, text) per entity: films, then people, cities, countries, each in index order."""
    docs = []
    for i, film in enumerate(world.films):
        docs.append((film_doc(world, i), f"{film.name} is a {film.year} film directed by {world.people[film.director].name}."))
    for i, person in enumerate(world.people):
        text = f"{person.name} was born in {world.cities[person.city].name}."
        if person.spouse is not None:
            text += f" {person.name} is married to {world.people[person.spouse].name}."
        docs.append((person_doc(world, i), text))
    for i, city in enumerate(world.cities):
        docs.append((city_doc(world, i), f"{city.name} is a city in {world.countries[city.country]}."))
    for i, name in enumerate(world.countries):
        docs.append((country_doc(world, i), f"{name} is a country."))
    return docs
