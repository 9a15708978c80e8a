"""Stage 1: the dataset (once, shared by runs) and each iteration's batch of training prompts."""

from __future__ import annotations

import random
from pathlib import Path

import schemas
from agent_core.config import DataConfig
from agent_core.data.loaders import load_qa_splits
from agent_core.data.prompt_files import load_prompt_files
from agent_core.data.rows import check_table_envs, document_to_row, prompt_to_row
from agent_core.data.synthetic import SyntheticQA, generate_synthetic_qa
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import TableReadError, read_table, table_exists, write_table, write_tables
from tasks._common import DatasetUris, completed_outputs, stage_logger, stage_task


def load_dataset(data: DataConfig) -> SyntheticQA:
    """The configured dataset: generated (synthetic), your own prompts (jsonl) or read from its native files."""
    if data.source == "jsonl":
        return load_prompt_files(dict(data.files), top_k=data.top_k, limit=data.limit)
    if data.source != "synthetic":
        settings = {"top_k": data.top_k, "limit": data.limit}
        if data.source != "musique":
            settings["setting"] = data.setting
        return load_qa_splits(data.source, dict(data.files), **settings)
    return generate_synthetic_qa(
        seed=data.seed, num_films=data.num_films, num_people=data.num_people, num_cities=data.num_cities,
        num_countries=data.num_countries, dev_fraction=data.dev_fraction, test_fraction=data.test_fraction,
        top_k=data.top_k, three_hop_fraction=data.three_hop_fraction,
        comparison_fraction=data.comparison_fraction, distractor_fraction=data.distractor_fraction,
        split_by=data.split_by, name_syllables=data.name_syllables, name_pool=data.name_pool,
    )


@stage_task(name="prepare_dataset")
def prepare_dataset(data_root: str, data: DataConfig) -> DatasetUris:
    """Generate or load the dataset and its corpus, unless this exact dataset exists already. A table
    there that is no longer readable Parquet (truncated, overwritten) is written again: the dataset is
    a function of the config (and its source files), so the same bytes come back and the runs that
    read it see no change."""
    log = stage_logger("prepare_dataset")
    dataset = load_dataset(data)
    root = DataRoot(Path(data_root))
    uris = DatasetUris(
        dataset.dataset_id,
        root.dataset_table_uri(dataset.dataset_id, "dataset_prompts"),
        root.dataset_table_uri(dataset.dataset_id, "corpus"),
    )
    if table_exists(uris.prompts_uri) and table_exists(uris.corpus_uri):
        try:
            prompts = read_table("dataset_prompts", uris.prompts_uri)
            read_table("corpus", uris.corpus_uri)
        except TableReadError as error:  # not Parquet any more (truncated, overwritten): made again, below
            log.warning("dataset %s: %s; writing the dataset again", dataset.dataset_id, error)
        else:
            # Every later stage reads these prompts: readable but hand-edited bad rows fail here, named.
            check_table_envs("dataset_prompts", prompts, uris.prompts_uri)
            log.info("dataset %s already prepared", dataset.dataset_id)
            return uris
    prompts = schemas.table_from_rows("dataset_prompts", [prompt_to_row(p) for p in dataset.prompts])
    check_table_envs("dataset_prompts", prompts, f"{data.source} dataset {dataset.dataset_id}, not written")
    # Both tables are checked before either is written: a bad one leaves no half-made dataset.
    write_tables(("corpus", [document_to_row(d) for d in dataset.documents], uris.corpus_uri),
                 ("dataset_prompts", prompts, uris.prompts_uri))
    log.info("dataset %s: %d prompts, %d documents", dataset.dataset_id, len(dataset.prompts), len(dataset.documents))
    return uris


@stage_task(name="prepare_data")
def prepare_data(run: RunLayout, iteration: int, dataset: DatasetUris, data: DataConfig, seed: int,
                 resume: bool = True) -> str:
    """Sample this iteration's training prompts (deterministic in seed and iteration)."""
    record = StageRecord(run.manifest_path("prepare_data", iteration), "prepare_data",
                         inputs={"dataset_prompts": dataset.prompts_uri},
                         params={"per_iteration": data.prompts_per_iteration, "seed": seed, "iteration": iteration})
    if (done := completed_outputs(record, resume, f"iteration {iteration} prompts")) is not None:
        return done["prompts"]
    prompts = read_table("dataset_prompts", dataset.prompts_uri)
    train_rows = [row for row in prompts.to_pylist() if row["split"] == "train"]
    if not train_rows:
        raise ValueError(f"{dataset.prompts_uri}: no prompts with split 'train'")
    count = min(data.prompts_per_iteration, len(train_rows))
    chosen = random.Random(f"{seed}:{iteration}").sample(train_rows, count)
    rows = [{"run_id": run.run_id, "iteration": iteration, **row} for row in chosen]
    uri = write_table("prompts", rows, run.table_uri(iteration, "prompts"))
    record.commit({"prompts": uri})
    stage_logger("prepare_data").info("iteration %d: %d training prompts", iteration, count)
    return uri
