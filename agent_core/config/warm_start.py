"""The `warm_start:` section: the supervised warm start before RL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agent_core.config._base import Section


_SOLVED_EPISODES = "select episode_id from rewards where em = 1"


class WarmStartConfig(Section):
    """Supervised warm start before RL: imitate selected episodes (agent_core/training/sft.py).

    On by default: a from-scratch policy produces no reward at all without it. source oracle: a
    scripted agent solves `prompts` training prompts of the built-in task first (and answers
    `rag_prompts` in the naive_rag format). steps: the episodes of an existing steps table
    (`steps_uri`, with its rewards table next to it). select_sql picks the episodes (DuckDB over
    views `steps` and `rewards`; must return episode_id); unset, every oracle episode (ideal and
    lazy ones alike: the oracle plays what it is asked to) or, for source steps, the solved ones.

    The defaults are the demo's recipe (docs/results.md): 4,000 oracle episodes, 75% of them lazy,
    one epoch on the action tokens. A strong warm start would leave RL nothing visible to do; this
    one copies names well but stops searching too early, which RL fixes within a few iterations.
    """

    enabled: bool = Field(True, description="run the supervised warm start before RL; false: RL starts from the "
                          "initial policy as is (one that already uses the tools, or a smoke run: configs/tiny.yaml)")
    source: Literal["oracle", "steps"] = Field(
        "oracle", description="oracle: episodes of the scripted agent on the built-in task; steps: episodes of an "
        "existing steps table (steps_uri)")
    prompts: int = Field(4000, ge=1, description="oracle: training prompts solved by the scripted agent")
    rag_prompts: int = Field(0, ge=0, description="oracle: training prompts answered in the naive_rag format too")
    lazy_fraction: float = Field(
        0.75, ge=0, le=1, description="oracle: share of the tool episodes that answer the bridge entity after one "
        "search (agent_core/data/oracle.py): a weak warm start whose searching RL must fix; 0 = all ideal")
    steps_uri: str | None = Field(None, description="source steps: a steps.parquet with rewards.parquet beside it")
    select_sql: str | None = Field(None, description="episodes to imitate; unset: see the class docstring")
    epochs: int = Field(1, ge=1, description="passes over the selected episodes")
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step")
    lr: float = Field(1e-3, gt=0, description="3e-3 left 2 of 4 seeds of the demo on a plateau (docs/results.md)")
    loss_on: Literal["actions", "all"] = Field(
        "actions", description="targets: the action tokens, or every token of the episode (language modelling)"
    )

    @model_validator(mode="after")
    def _steps_source_has_a_table(self) -> "WarmStartConfig":
        if self.source == "steps" and not self.steps_uri:
            raise ValueError("warm_start.source=steps needs warm_start.steps_uri (a steps.parquet)")
        if (self.source == "oracle" and self.lazy_fraction > 0 and self.select_sql is not None
                and " ".join(self.select_sql.split()) == _SOLVED_EPISODES):
            raise ValueError("warm_start.lazy_fraction > 0 records lazy episodes with em 0, which this select_sql "
                             "drops; leave warm_start.select_sql unset (every oracle episode) or set lazy_fraction: 0")
        return self

    @property
    def selection_sql(self) -> str:
        """The SQL that picks the episodes to imitate (select_sql, or the source's default)."""
        if self.select_sql is not None:
            return self.select_sql
        return "select episode_id from rewards" if self.source == "oracle" else _SOLVED_EPISODES
