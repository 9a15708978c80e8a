"""The made-up world behind the built-in synthetic task: films, people, cities, countries, and the
one short document per entity that states its facts.

- each film has a year and a director (a person);
- each person has a birth city and, for about MARRIED_FRACTION of them, a spouse (symmetric);
- each city lies in a country.

Names are built from a small, regular syllable inventory and never use an English word of the
templates, so a tiny tokenizer trained on this text stays small. Every entity's full name is
unique, but about `distractor_fraction` of the people and films are *namesakes*: a person who shares
a first name or a surname with an earlier person, or a film whose title holds a person's surname
("Dunmar Kelvo" next to "Tessa Dunmar"). A search on part of a name can therefore rank the wrong
entity first, as on real corpora; a search on the full name still finds the entity's own page in
the top 3 (its own page repeats both name words, others hold one).
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


def _person_names(rng: random.Random, names: _NameMaker, count: int, distractor_fraction: float) -> list[str]:
    """Two-word names; a namesake keeps an earlier person's first name or surname in its place."""
    person_names: list[str] = []
    for _ in range(count):
        if person_names and rng.random() < distractor_fraction:
            first, surname = rng.choice(person_names).split()
            person_names.append(f"{first} {names.word(2)}" if rng.random() < 0.5 else f"{names.word(2)} {surname}")
        else:
            person_names.append(f"{names.word(2)} {names.word(2)}")
    return person_names


def _film_title(rng: random.Random, names: _NameMaker, person_names: list[str], distractor_fraction: float) -> str:
    if rng.random() < distractor_fraction:
        surname = rng.choice(person_names).split()[1]
        return f"{surname} {names.word(2)}" if rng.random() < 0.5 else f"{names.word(2)} {surname}"
    return f"{names.word(2)} {names.word(2)}"


def build_world(rng: random.Random, sizes: WorldSizes, distractor_fraction: float, reserved_words: Collection[str]) -> World:
    names = _NameMaker(rng, reserved_words)
    countries = tuple(names.word(1, _COUNTRY_SUFFIXES) for _ in range(sizes.num_countries))
    cities = tuple(
        City(names.word(1, _CITY_SUFFIXES), rng.randrange(sizes.num_countries)) for _ in range(sizes.num_cities)
    )
    person_names = _person_names(rng, names, sizes.num_people, distractor_fraction)
    birth_cities = [rng.randrange(sizes.num_cities) for _ in range(sizes.num_people)]
    spouses = _marry(rng, birth_cities, num_pairs=int(sizes.num_people * MARRIED_FRACTION) // 2)
    people = tuple(Person(name, birth_cities[i], spouses.get(i)) for i, name in enumerate(person_names))
    films = tuple(
        Film(
            _film_title(rng, names, person_names, distractor_fraction),
            rng.randint(FIRST_FILM_YEAR, LAST_FILM_YEAR),
            rng.randrange(sizes.num_people),
        )
        for _ in range(sizes.num_films)
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
