"""Stage 1: the dataset (once, shared by runs) and each iteration's batch of training prompts."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import schemas
from agent_core.config import DataConfig
from agent_core.data.loaders import load_qa_splits
from agent_core.data.prompt_files import load_prompt_files
from agent_core.data.rows import check_table_envs, document_to_row, prompt_to_row
from agent_core.data.synthetic import SyntheticQA, generate_synthetic_qa
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.manifests import StageRecord, read_manifest
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
    """Generate or load the dataset and its corpus, unless this exact dataset exists already. The
    dataset is a function of its id: the config for a generated one, the source files' bytes and
    the load settings for a loaded one (loaded again on every call, agent_core/data/loaders.py), so
    it can always be rebuilt to the same bytes. Hence a table there that is no longer readable
    Parquet, or that is readable but holds other rows than a fresh build of the dataset (edited by
    hand; compared on every reuse, ~0.3 s for the default synthetic dataset: the dataset's manifest,
    `datasets/<id>/_manifests/prepare_dataset.json`, can be edited to match), is named and written
    again; the runs that read it see no change. An edited file is kept aside
    (`<table>.parquet.edited-<time>`), never used. Tables equal to the fresh build whose manifest is
    missing (prepared before dataset manifests) or does not match get their SHA-256 recorded."""
    log = stage_logger("prepare_dataset")
    dataset = load_dataset(data)
    root = DataRoot(Path(data_root))
    uris = DatasetUris(
        dataset.dataset_id,
        root.dataset_table_uri(dataset.dataset_id, "dataset_prompts"),
        root.dataset_table_uri(dataset.dataset_id, "corpus"),
    )
    outputs = {"dataset_prompts": uris.prompts_uri, "corpus": uris.corpus_uri}
    record = StageRecord(root.dataset_dir(dataset.dataset_id) / "_manifests" / "prepare_dataset.json",
                         "prepare_dataset", inputs={}, params={"dataset_id": dataset.dataset_id})
    built, forged = _Built(dataset, data.source), False
    if table_exists(uris.prompts_uri) and table_exists(uris.corpus_uri):
        try:
            found = {name: read_table(name, uri) for name, uri in outputs.items()}
        except TableReadError as error:  # not Parquet any more (truncated, overwritten): made again, below
            log.warning("dataset %s: %s; writing the dataset again", dataset.dataset_id, error)
        else:
            # Every later stage reads these prompts: readable but hand-edited bad rows fail here, named.
            check_table_envs("dataset_prompts", found["dataset_prompts"], uris.prompts_uri)
            changed = [name for name in outputs if not _same_rows(found[name], built.table(name))]
            if not changed:
                _record_checked(record, outputs, dataset.dataset_id, log)
                log.info("dataset %s already prepared", dataset.dataset_id)
                return uris
            forged = record.completed() is not None  # the manifest vouches for the edited tables
            kept = [_keep_aside(Path(outputs[name])) for name in changed]
            log.warning("dataset %s: %s changed since it was prepared%s; rebuilt from its %s source, the edited "
                        "file kept as %s (to train on other data, give it as a dataset of its own: data.source jsonl)",
                        dataset.dataset_id, " and ".join(Path(outputs[n]).name for n in changed),
                        " (its manifest edited to match)" if forged else "", data.source,
                        " and ".join(path.name for path in kept))
    prompts = built.table("dataset_prompts")
    check_table_envs("dataset_prompts", prompts, f"{data.source} dataset {dataset.dataset_id}, not written")
    # Both tables are checked before either is written: a bad one leaves no half-made dataset.
    write_tables(("corpus", built.table("corpus"), uris.corpus_uri), ("dataset_prompts", prompts, uris.prompts_uri))
    before = None if forged else read_manifest(record.path)
    after = record.commit(outputs, counted=False)  # a dataset is no run's output (run_status.record_run_failure)
    if before is not None and before.output_fingerprints != after.output_fingerprints:
        log.warning("dataset %s: the rebuilt tables' bytes differ from those first prepared (another pyarrow?); "
                    "the stages that read them will run again", dataset.dataset_id)
    log.info("dataset %s: %d prompts, %d documents", dataset.dataset_id, len(dataset.prompts), len(dataset.documents))
    return uris


class _Built:
    """The dataset's tables as prepare_dataset writes them, built on first use."""

    def __init__(self, dataset: SyntheticQA, source: str):
        self.dataset, self.source, self._tables = dataset, source, {}

    def table(self, name: str):
        if name not in self._tables:
            rows = ([prompt_to_row(p) for p in self.dataset.prompts] if name == "dataset_prompts"
                    else [document_to_row(d) for d in self.dataset.documents])
            self._tables[name] = schemas.table_from_rows(name, rows)
        return self._tables[name]


def _same_rows(found, built) -> bool:
    """Whether a table read back holds exactly the rows of the fresh build (`_Built.table`): the
    content the dataset id pins, never the manifest's word (a hand edit can rewrite that too)."""
    try:
        return found.equals(built.cast(found.schema))
    except (ValueError, TypeError):  # ArrowInvalid, ArrowTypeError: columns of another type, edited
        return False


def _record_checked(record: StageRecord, outputs: dict[str, str], dataset_id: str, log) -> None:
    """Record the SHA-256 of tables just found equal to a fresh build where the manifest does not
    match them: none (prepared before datasets had manifests, or damaged), or other bytes."""
    check = record.check()
    if check.outputs is not None:
        return
    record.commit(outputs, counted=False)
    why = ("had no manifest (prepared before datasets had them, or it was damaged)" if check.reason == "no manifest"
           else f"had a manifest that did not match its tables ({check.reason})")
    log.warning("dataset %s %s: its tables equal a fresh build, their SHA-256 now recorded in %s",
                dataset_id, why, record.path)


def _keep_aside(path: Path) -> Path:
    """Move an edited dataset table out of the way (a name no reader globs): the user's edit is kept."""
    kept = path.with_name(f"{path.name}.edited-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}")
    os.replace(path, kept)
    return kept


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
