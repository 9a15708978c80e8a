"""The `data:` section: the prompts and the corpus (agent_core/data)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agent_core.config._base import Section


class DataConfig(Section):
    """The prompts and the corpus: the built-in synthetic multi-hop QA task (generated
    deterministically from `seed`), or a real dataset read from its native files.

    synthetic: the num_* sizes and *_fraction mix shape the generated world and questions. The
    defaults are the demo's task: 2-hop bridge questions about 2,000 films and 2,000 people whose
    one-syllable names are pairs from pools of 80 words, one passage per search (short contexts:
    what the tiny policy can learn to copy from on 2 cores; docs/results.md). The harder mix (3-hop,
    comparisons, namesakes, top_k 3) is a setting away.
    hotpotqa / 2wikimultihopqa / musique: `files` maps split names (train, dev, test) to native
    files (e.g. {train: hotpot_train_v1.1.json, dev: hotpot_dev_distractor_v1.json}); `setting` is
    HotpotQA / 2Wiki's distractor or fullwiki; `limit` keeps the first N questions of each file.
    jsonl: your own prompts, `files` maps split names to JSON-lines files of {id, question or
    messages, answers, env?, metadata?, documents?} (agent_core/data/prompt_files.py).
    """

    source: Literal["synthetic", "hotpotqa", "2wikimultihopqa", "musique", "jsonl"] = Field(
        "synthetic", description="where prompts and corpus come from: the generated task, a real dataset's native "
        "files, or your own JSON-lines prompts (real ones and jsonl need `files`)")
    seed: int = Field(0, description="synthetic: seed of the generated world, questions and splits; change it for "
                      "another task of the same shape (the run's own `seed` is separate)")
    num_films: int = Field(2000, ge=4, description="synthetic: films in the generated world (more: more questions)")
    num_people: int = Field(2000, ge=4, description="synthetic: people in the generated world")
    num_cities: int = Field(40, ge=2, description="synthetic: cities (shared by all splits)")
    num_countries: int = Field(12, ge=2, description="synthetic: countries (shared by all splits)")
    dev_fraction: float = Field(0.1, ge=0, lt=1, description="synthetic: share of questions held out as the dev "
                                "split (assigned in whole key-person groups, see split_by); dev + test must be < 1")
    test_fraction: float = Field(0.1, ge=0, lt=1, description="synthetic: share of questions held out as the test "
                                 "split, like dev_fraction")
    three_hop_fraction: float = Field(0.0, ge=0, lt=1, description="synthetic: share of 3-hop bridge questions")
    comparison_fraction: float = Field(0.0, ge=0, lt=1, description="synthetic: share of comparison questions")
    distractor_fraction: float = Field(0.0, ge=0, le=1, description="synthetic: share of namesake entities")
    name_syllables: int = Field(1, ge=1, description="synthetic: syllables per name word")
    name_pool: int = Field(
        80, ge=0, description="synthetic: 0 = every name word used once; k = names are pairs of words from pools of k"
    )
    split_by: Literal["key_people", "question"] = Field(
        "key_people", description="synthetic: held-out questions start from unseen people, or are unseen questions"
    )
    files: dict[Literal["train", "dev", "test"], str] = Field(
        default_factory=dict, description="real datasets: split name -> native file"
    )
    setting: Literal["distractor", "fullwiki"] = Field(
        "distractor", description="hotpotqa / 2wikimultihopqa: the files' setting; distractor: each question's own "
        "paragraphs (their ids kept in metadata for analysis); fullwiki: a retriever's, so supporting ones may be "
        "missing. Search always runs over the whole corpus")
    limit: int | None = Field(None, ge=1, description="real datasets: first N questions of each file")
    top_k: int = Field(1, ge=1, description="passages returned by one search call")
    prompts_per_iteration: int = Field(16, ge=1, description="training prompts sampled per iteration")

    @model_validator(mode="after")
    def _real_datasets_have_files(self) -> "DataConfig":
        if self.source != "synthetic" and not self.files:
            raise ValueError(f"data.source={self.source} needs data.files, e.g. {{train: /path/file, dev: /path/file}}")
        if self.source == "synthetic" and self.files:
            raise ValueError("data.files is for real datasets; set data.source to hotpotqa, 2wikimultihopqa, musique "
                             "or jsonl")
        return self
