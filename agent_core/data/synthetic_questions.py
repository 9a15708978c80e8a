"""Questions about the synthetic world (synthetic_world.py), shaped like HotpotQA's two kinds.

Bridge questions (a chain of documents, 2- or 3-hop) and comparison questions (two entities compared); `hops`
counts reasoning steps as HotpotQA does. Every question carries its oracle plan (the full names to search, in
order, and the answer) and its key people, by which the generator splits train / dev / test.
Design notes: docs/architecture.md §11 (agent_core/data/synthetic_questions.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from agent_core.data.synthetic_world import DocRef, World, city_doc, film_doc, person_doc

BRIDGE, COMPARISON = "bridge", "comparison"
YES, NO = "yes", "no"


@dataclass(frozen=True)
class QuestionTemplate:
    text: str  # slots: {film}, {person}, or {film_a} and {film_b}
    type: str  # BRIDGE or COMPARISON
    hops: int


TEMPLATES: dict[str, QuestionTemplate] = {
    "director_birthplace": QuestionTemplate("Where was the director of {film} born?", BRIDGE, 2),
    "director_spouse": QuestionTemplate("Who is the spouse of the director of {film}?", BRIDGE, 2),
    "person_country": QuestionTemplate("In which country was {person} born?", BRIDGE, 2),
    "spouse_birthplace": QuestionTemplate("Where was the spouse of {person} born?", BRIDGE, 2),
    "director_country": QuestionTemplate("In which country was the director of {film} born?", BRIDGE, 3),
    "director_spouse_birthplace": QuestionTemplate("Where was the spouse of the director of {film} born?", BRIDGE, 3),
    "spouse_country": QuestionTemplate("In which country was the spouse of {person} born?", BRIDGE, 3),
    "film_earlier": QuestionTemplate("Which film was released earlier, {film_a} or {film_b}?", COMPARISON, 2),
    "directors_same_city": QuestionTemplate(
        "Were the directors of {film_a} and {film_b} born in the same city?", COMPARISON, 3
    ),
}
_COMPARISONS = tuple(name for name, t in TEMPLATES.items() if t.type == COMPARISON)
_ATTEMPTS_PER_COMPARISON = 20


@dataclass(frozen=True)
class Question:
    template: str
    text: str
    answer: str
    supporting: tuple[DocRef, ...]  # in the order the oracle reads them
    key_people: frozenset[int]  # people (indices) this question hinges on; splits never share one

    @property
    def queries(self) -> tuple[str, ...]:
        """What the oracle searches: each supporting document's full title, in reading order."""
        return tuple(ref.title for ref in self.supporting)


def _bridge(template: str, slot: dict[str, str], answer: str, chain: list[DocRef], key_person: int) -> Question:
    return Question(template, TEMPLATES[template].text.format(**slot), answer, tuple(chain), frozenset({key_person}))


def bridge_questions(world: World) -> tuple[list[Question], list[Question]]:
    """(every 2-hop bridge question, every 3-hop bridge question), in a fixed order."""
    people, cities, countries = world.people, world.cities, world.countries
    two_hop: list[Question] = []
    three_hop: list[Question] = []
    for i, film in enumerate(world.films):
        d = film.director
        director = people[d]
        slot, chain = {"film": film.name}, [film_doc(world, i), person_doc(world, d)]
        two_hop.append(_bridge("director_birthplace", slot, cities[director.city].name, chain, d))
        country = countries[cities[director.city].country]
        three_hop.append(_bridge("director_country", slot, country, [*chain, city_doc(world, director.city)], d))
        if director.spouse is not None:
            spouse = people[director.spouse]
            two_hop.append(_bridge("director_spouse", slot, spouse.name, chain, d))
            three_hop.append(_bridge("director_spouse_birthplace", slot, cities[spouse.city].name,
                                     [*chain, person_doc(world, director.spouse)], d))
    for i, person in enumerate(people):
        slot = {"person": person.name}
        own = person_doc(world, i)
        country = countries[cities[person.city].country]
        two_hop.append(_bridge("person_country", slot, country, [own, city_doc(world, person.city)], i))
        if person.spouse is not None:
            spouse = people[person.spouse]
            chain = [own, person_doc(world, person.spouse)]
            two_hop.append(_bridge("spouse_birthplace", slot, cities[spouse.city].name, chain, i))
            spouse_country = countries[cities[spouse.city].country]
            three_hop.append(_bridge("spouse_country", slot, spouse_country, [*chain, city_doc(world, spouse.city)], i))
    return two_hop, three_hop


def comparison_questions(world: World, rng: random.Random, films: list[int], count: int) -> list[Question]:
    """Up to `count` distinct comparisons among `films` (indices), the two templates alternating.

    Fewer when the films do not allow more (e.g. fewer than two films, or all of the same year).
    """
    questions: list[Question] = []
    seen: set[tuple[str, frozenset[int]]] = set()
    if len(films) < 2:
        return questions
    failures = 0
    for _ in range(count * _ATTEMPTS_PER_COMPARISON):
        if len(questions) == count:
            break
        template = _COMPARISONS[len(questions) % len(_COMPARISONS)]
        if template == "film_earlier":
            pair = _film_earlier_pair(world, rng, films)
        else:
            # yes and no alternate, so the answers are balanced unless the films allow few of one
            made = sum(q.template == template for q in questions)
            pair = _directors_pair(world, rng, films, want_same=made % 2 == 0 and failures < _ATTEMPTS_PER_COMPARISON)
        if pair is None or (template, frozenset(pair)) in seen:
            failures += 1
            continue
        seen.add((template, frozenset(pair)))
        questions.append(_comparison(world, template, *pair))
        failures = 0
    return questions


def _film_earlier_pair(world: World, rng: random.Random, films: list[int]) -> tuple[int, int] | None:
    a, b = rng.sample(films, 2)
    return None if world.films[a].year == world.films[b].year else (a, b)


def _directors_pair(world: World, rng: random.Random, films: list[int], want_same: bool) -> tuple[int, int] | None:
    """Two films by different directors, born in the same city if `want_same` and the films allow."""
    a = rng.choice(films)
    director_a = world.films[a].director
    city_a = world.people[director_a].city
    others = [b for b in films if world.films[b].director != director_a]
    same = [b for b in others if world.people[world.films[b].director].city == city_a]
    different = [b for b in others if world.people[world.films[b].director].city != city_a]
    pool = same if want_same else different
    return (a, rng.choice(pool)) if pool else None


def _comparison(world: World, template: str, a: int, b: int) -> Question:
    film_a, film_b = world.films[a], world.films[b]
    text = TEMPLATES[template].text.format(film_a=film_a.name, film_b=film_b.name)
    films = [film_doc(world, a), film_doc(world, b)]
    key_people = frozenset({film_a.director, film_b.director})
    if template == "film_earlier":
        answer = film_a.name if film_a.year < film_b.year else film_b.name
        return Question(template, text, answer, tuple(films), key_people)
    same_city = world.people[film_a.director].city == world.people[film_b.director].city
    directors = [person_doc(world, film_a.director), person_doc(world, film_b.director)]
    return Question(template, text, YES if same_city else NO, (*films, *directors), key_people)
