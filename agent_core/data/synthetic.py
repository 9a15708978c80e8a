"""The built-in synthetic multi-hop QA task: a made-up world of films, people, cities and countries
(synthetic_world.py), HotpotQA-style questions about it (synthetic_questions.py), and their splits.

Everything follows from `random.Random(seed)`: the same arguments give the same prompts on any machine.
Differs from a plain random split: people go to splits in whole groups, so no test (or dev) question starts
from a film or person that any training question starts from or hinges on (docs/architecture.md §10).
Design notes: docs/architecture.md §11 (agent_core/data/synthetic.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from agent_core.data.synthetic_questions import TEMPLATES, Question, bridge_questions, comparison_questions
from agent_core.data.synthetic_world import NameStyle, World, WorldSizes, build_world, world_documents
from agent_core.types import ChatMessage, Document, Prompt

# Bump when the generated text changes, so a new generator never reuses an old dataset folder.
# 2: the system prompt leaves tool syntax to the env's tool-call format
# 3: 3-hop and comparison questions, namesake distractors, oracle plans in the metadata
GENERATOR_VERSION = 3

# How to call the search tool is the env's tool-call format's to say (tag or hermes), not the data's.
SYSTEM_PROMPT = "Answer the question. Search as often as you need before answering."

# Words of the fixed text that names must never be (keeps a search for a name about that name).
_RESERVED_WORDS = frozenset(
    word.strip("?.,{}").lower()
    for text in (*(t.text for t in TEMPLATES.values()), SYSTEM_PROMPT,
                 "is a film directed by was born in is married to is a city in is a country yes no")
    for word in text.split()
)
_HELD_OUT = ("test", "dev")
SPLIT_MODES = ("key_people", "question")


@dataclass(frozen=True)
class SyntheticQA:
    """The generated task: prompts (all splits, in id order), the corpus, and its dataset id."""

    prompts: tuple[Prompt, ...]
    documents: tuple[Document, ...]
    dataset_id: str


@dataclass(frozen=True)
class _SplitTargets:
    dev_fraction: float
    test_fraction: float

    def fraction(self, split: str) -> float:
        return self.dev_fraction if split == "dev" else self.test_fraction


def _assign_people(questions: list[Question], rng: random.Random, targets: _SplitTargets) -> dict[int, str]:
    """Key person -> split, whole groups of questions at a time (see the module docstring)."""
    groups: dict[int, int] = {}
    for question in questions:
        (person,) = question.key_people
        groups[person] = groups.get(person, 0) + 1
    people = list(groups)
    rng.shuffle(people)
    wanted = {split: round(len(questions) * targets.fraction(split)) for split in _HELD_OUT}
    filled = dict.fromkeys(_HELD_OUT, 0)
    split_of = {}
    for person in people:
        split_of[person] = "train"
        for split in _HELD_OUT:
            if filled[split] + groups[person] <= wanted[split]:
                filled[split] += groups[person]
                split_of[person] = split
                break
    return split_of


def _by_question(world: World, bridges: list[Question], comparisons: int, targets: _SplitTargets,
                 rng: random.Random) -> list[tuple[Question, str]]:
    """split_by="question": every question drawn into a split at random (its entities may appear in
    other splits' questions, its combination of template and entities does not)."""
    questions = bridges + comparison_questions(world, rng, list(range(len(world.films))), comparisons)
    rng.shuffle(questions)
    sizes = {split: round(len(questions) * targets.fraction(split)) for split in _HELD_OUT}
    labels = ["test"] * sizes["test"] + ["dev"] * sizes["dev"]
    labels += ["train"] * (len(questions) - len(labels))
    return list(zip(questions, labels))


def _questions_by_split(world: World, arguments: dict, rng: random.Random) -> list[tuple[Question, str]]:
    two_hop, three_hop_pool = bridge_questions(world)
    target_total = len(two_hop) / (1 - arguments["three_hop_fraction"] - arguments["comparison_fraction"])
    three_hop = rng.sample(three_hop_pool, min(len(three_hop_pool), round(target_total * arguments["three_hop_fraction"])))
    bridges = two_hop + three_hop
    targets = _SplitTargets(arguments["dev_fraction"], arguments["test_fraction"])
    if arguments.get("split_by", "key_people") == "question":
        labelled = _by_question(world, bridges, round(target_total * arguments["comparison_fraction"]), targets, rng)
        rng.shuffle(labelled)
        return labelled
    split_of = _assign_people(bridges, rng, targets)
    labelled = [(q, split_of[next(iter(q.key_people))]) for q in bridges]
    comparisons = round(target_total * arguments["comparison_fraction"])
    for split in ("train", *_HELD_OUT):
        share = sum(s == split for _, s in labelled) / len(bridges)
        films = [i for i, film in enumerate(world.films) if split_of[film.director] == split]
        labelled += [(q, split) for q in comparison_questions(world, rng, films, round(comparisons * share))]
    rng.shuffle(labelled)
    return labelled


def _prompt(number: int, seed: int, question: Question, split: str, top_k: int) -> Prompt:
    template = TEMPLATES[question.template]
    return Prompt(
        prompt_id=f"synth-{seed}-{number}",
        data_source="synthetic",
        split=split,
        messages=(ChatMessage("system", SYSTEM_PROMPT), ChatMessage("user", f"Question: {question.text}")),
        answers=(question.answer,),
        env_name="search_qa",
        env_kwargs={"top_k": top_k},
        metadata={
            "hops": template.hops,
            "type": template.type,
            "template": question.template,
            "supporting_doc_ids": [ref.doc_id for ref in question.supporting],
            "oracle_plan": {"queries": list(question.queries), "answer": question.answer},
        },
    )


def _dataset_id(arguments: dict[str, float | int]) -> str:
    digest = hashlib.sha256(json.dumps({**arguments, "version": GENERATOR_VERSION}, sort_keys=True).encode())
    a = arguments
    return (
        f"synthetic-s{a['seed']}-f{a['num_films']}-p{a['num_people']}-c{a['num_cities']}"
        f"-n{a['num_countries']}-{digest.hexdigest()[:8]}"
    )


def _check_arguments(arguments: dict[str, float | int]) -> None:
    minimums = {"num_films": 1, "num_people": 2, "num_cities": 1, "num_countries": 1, "top_k": 1,
                "name_syllables": 1, "name_pool": 0}
    for name, minimum in minimums.items():
        if name not in arguments:
            continue
        if not isinstance(arguments[name], int) or arguments[name] < minimum:
            raise ValueError(f"generate_synthetic_qa: {name} must be an integer >= {minimum}, got {arguments[name]!r}")
    for name in ("dev_fraction", "test_fraction", "three_hop_fraction", "comparison_fraction"):
        if not 0 <= arguments[name] < 1:
            raise ValueError(f"generate_synthetic_qa: {name} must be in [0, 1), got {arguments[name]!r}")
    if not 0 <= arguments["distractor_fraction"] <= 1:
        raise ValueError(f"generate_synthetic_qa: distractor_fraction must be in [0, 1], got {arguments['distractor_fraction']!r}")
    if arguments["dev_fraction"] + arguments["test_fraction"] >= 1:
        raise ValueError("generate_synthetic_qa: dev_fraction + test_fraction must be < 1 (leave some training data)")
    if arguments["three_hop_fraction"] + arguments["comparison_fraction"] >= 1:
        raise ValueError(
            "generate_synthetic_qa: three_hop_fraction + comparison_fraction must be < 1 (the rest are 2-hop bridges)"
        )


def generate_synthetic_qa(
    seed: int,
    num_films: int = 200,
    num_people: int = 120,
    num_cities: int = 40,
    num_countries: int = 12,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
    top_k: int = 3,
    three_hop_fraction: float = 0.25,
    comparison_fraction: float = 0.2,
    distractor_fraction: float = 0.3,
    split_by: str = "key_people",
    name_syllables: int = 2,
    name_pool: int = 0,
) -> SyntheticQA:
    """Generate the task. Same arguments -> identical output (prompts, documents, order, ids).

    three_hop_fraction / comparison_fraction: about this share of all questions are 3-hop bridges /
        comparisons (3-hop ones are capped by how many the world allows); the rest are 2-hop bridges.
    distractor_fraction: the share of people and films named after another person (see
        synthetic_world.py), whose pages compete in searches on part of a name.
    split_by: "key_people" (the default; see the module docstring) or "question": a random split
        of the questions, so a held-out question is a combination of template and entities never
        seen in training, but its entities may be (a model can then answer from what it memorised).
    name_syllables: syllables per name word. name_pool: 0 = every name word used once (namesakes
        by distractor_fraction); k = people's and films' names are pairs of words from pools of k
        words each (synthetic_world.py), so a large world needs few distinct words.
    """
    arguments = dict(
        seed=seed, num_films=num_films, num_people=num_people, num_cities=num_cities,
        num_countries=num_countries, dev_fraction=dev_fraction, test_fraction=test_fraction, top_k=top_k,
        three_hop_fraction=three_hop_fraction, comparison_fraction=comparison_fraction,
        distractor_fraction=distractor_fraction,
    )
    if split_by not in SPLIT_MODES:
        raise ValueError(f"generate_synthetic_qa: split_by must be one of {', '.join(SPLIT_MODES)}, got {split_by!r}")
    # Settings at their original defaults stay out of the id: existing datasets keep theirs.
    for name, value, original in (("split_by", split_by, "key_people"), ("name_syllables", name_syllables, 2),
                                  ("name_pool", name_pool, 0)):
        if value != original:
            arguments[name] = value
    _check_arguments(arguments)
    rng = random.Random(seed)
    sizes = WorldSizes(num_films, num_people, num_cities, num_countries)
    world = build_world(rng, sizes, distractor_fraction, _RESERVED_WORDS, NameStyle(name_syllables, name_pool))
    labelled = _questions_by_split(world, arguments, rng)
    prompts = tuple(_prompt(n, seed, question, split, top_k) for n, (question, split) in enumerate(labelled))
    documents = tuple(Document(ref.doc_id, ref.title, text) for ref, text in world_documents(world))
    return SyntheticQA(prompts=prompts, documents=documents, dataset_id=_dataset_id(arguments))
