"""Checkpoint retention (the `checkpoints:` section): which iterations' checkpoints, critics and
optimizer states a run keeps, and pruning the rest so that a kill at any moment leaves a run that
resumes to the same tables.

Only iterations before the newest committed one (its train manifest written) are candidates: the
newest is what resume and the next rollout read. Pruning one path is three steps, each safe to die
after: write its tombstone (agent_core/io/tombstones.py: the fingerprint the manifests recorded),
rename it to a hidden temporary (`locks.sweep_temporaries` removes one a kill left), delete that.
Design notes: docs/architecture.md §8 (checkpoint retention).
"""

from __future__ import annotations

import dataclasses
import fcntl
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb

from agent_core.config import CheckpointsConfig
from agent_core.failpoints import failpoint
from agent_core.io.atomic import fsync_directory, write_text_atomic
from agent_core.io.disk_use import freed_by_deleting
from agent_core.io.layout import RunLayout
from agent_core.io.lora_checkpoints import is_lora_checkpoint, lora_base_dir
from agent_core.io.manifests import fingerprint, output_size, read_manifest
from agent_core.io.summaries import eval_scores
from agent_core.io.tombstones import Tombstone, pruned_message, read_tombstone, tombstone_json, tombstone_path

# What an iteration folder holds that retention may prune: (kind, whether it follows the checkpoint
# rules; the others, optimizer states, are kept for the newest committed iteration only)
_KINDS = (("checkpoint", True), ("critic", True), ("optimizer", False), ("critic_optimizer", False))


@dataclass(frozen=True)
class PruneItem:
    """One path retention lets go."""

    kind: str  # checkpoint, critic, optimizer, critic_optimizer or initial_policy
    iteration: int  # -1: the run's own (initial_policy)
    path: Path
    bytes: int
    reason: str  # the rule, e.g. "checkpoints.keep_last=1"
    recorded: str | None = None  # the fingerprint the train manifest recorded (None: hashed when pruned)


@dataclass(frozen=True)
class PrunePlan:
    """What pruning a run would remove now, and why the rest stays."""

    run_id: str
    items: tuple[PruneItem, ...]
    kept: Mapping[int, str]  # iteration -> why its checkpoint stays ("newest", "best dev EM 0.40", ...)
    newest: int | None  # the newest committed iteration (None: nothing committed yet)

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.items)


def iteration_paths(run: RunLayout, iteration: int) -> dict[str, Path]:
    return {"checkpoint": run.checkpoint_dir(iteration), "critic": run.critic_dir(iteration),
            "optimizer": run.optimizer_state_path(iteration),
            "critic_optimizer": run.critic_optimizer_state_path(iteration)}


def committed_iterations(run: RunLayout) -> list[int]:
    """Iterations 0..k whose trainings committed one after another: each train manifest read the policy
    and optimizer state the one before recorded as its outputs. A later manifest from before a changed
    setting reran an earlier iteration is stale (its iteration reruns), so the chain, and what resume
    may still read, ends before it. Reads manifests only: no checkpoint is hashed."""
    return list(_committed_train_manifests(run))


def _committed_train_manifests(run: RunLayout) -> dict:
    """`committed_iterations` -> each one's train manifest (read once: plan_prune needs their fingerprints)."""
    committed, before = {}, None
    for k in run.iterations():
        manifest = read_manifest(run.manifest_path("train", k))
        if manifest is None or (before is not None and not _reads_outputs_of(manifest, before)):
            break
        committed[k] = before = manifest
    return committed


# a train manifest's input -> the output of the iteration before that it is
_CHAINED = {"policy": "checkpoint", "optimizer": "optimizer", "critic": "critic", "critic_optimizer": "critic_optimizer"}


def _reads_outputs_of(manifest, before) -> bool:
    return all(manifest.inputs.get(name) == before.output_fingerprints.get(output)
               for name, output in _CHAINED.items() if output in before.output_fingerprints)


def dev_em_by_iteration(run: RunLayout, iterations: list[int]) -> dict[int, float]:
    """The held-out EM after each evaluated iteration (those without a dev_eval table are left out)."""
    evaluated = [k for k in iterations if Path(run.dev_eval_uri(k)).is_file()]
    if not evaluated:
        return {}
    with duckdb.connect() as con:  # one connection for all (opening one costs more than a query)
        scores = {k: eval_scores(run.dev_eval_uri(k), con)[0] for k in evaluated}
    return {k: em for k, em in scores.items() if not math.isnan(em)}


def kept_iterations(committed: list[int], policy: CheckpointsConfig, dev_em: Mapping[int, float]) -> dict[int, str]:
    """Iteration -> why its checkpoint and critic stay under `policy` (pure: the rules in one place)."""
    if not committed:
        return {}
    if policy.keep_all:
        return {k: "checkpoints.keep_all" for k in committed}
    kept = {k: f"checkpoints.keep_last={policy.keep_last}" for k in committed[-policy.keep_last:]}
    kept[committed[-1]] = "newest (resume reads it)"
    if policy.keep_every:
        for k in committed:
            if (k + 1) % policy.keep_every == 0:
                kept.setdefault(k, f"checkpoints.keep_every={policy.keep_every}")
    scored = [(em, k) for k, em in dev_em.items() if k in committed]
    if policy.keep_best and scored:
        em, best = max(scored)  # ties: the later iteration
        kept.setdefault(best, f"best dev EM {em:.3f}")
    return kept


def plan_prune(run: RunLayout, policy: CheckpointsConfig, pinned: frozenset[int] = frozenset()) -> PrunePlan:
    """What `policy` lets go in `run` now. `pinned`: iterations kept whatever the rules say."""
    manifests = _committed_train_manifests(run)
    committed = list(manifests)
    kept = kept_iterations(committed, policy, dev_em_by_iteration(run, committed))
    kept.update({k: "in use by a reader" for k in pinned if k in committed and k not in kept})
    newest = committed[-1] if committed else None
    items = []
    for k in committed:
        if policy.keep_all or k == newest:
            continue
        for kind, follows_checkpoint in _KINDS:
            if follows_checkpoint and k in kept:
                continue
            path = iteration_paths(run, k)[kind]
            if path.exists():
                reason = (f"checkpoints.keep_last={policy.keep_last}" if follows_checkpoint
                          else "optimizer state: only the newest iteration's is kept")
                recorded = manifests[k].output_fingerprints.get(kind)
                items.append(PruneItem(kind, k, path, freed_by_deleting(path), reason, recorded))
    if not policy.keep_all and newest is not None and (initial := _initial_policy_item(run, newest)):
        items.append(initial)
    return PrunePlan(run.run_id, tuple(items), kept, newest)


def _initial_policy_item(run: RunLayout, newest: int) -> PruneItem | None:
    """The initial policy once a warm start replaced it as what RL starts from (and the KL reference):
    a copy of the source model nothing reads any more, unless a LoRA checkpoint is an adapter on it."""
    warm = read_manifest(run.manifest_path("warm_start"))
    initial = read_manifest(run.manifest_path("init_policy"))
    if warm is None or initial is None or not run.initial_policy_dir.is_dir() or not run.warm_start_policy_dir.is_dir():
        return None
    newest_checkpoint = run.checkpoint_dir(newest)
    if is_lora_checkpoint(newest_checkpoint) and lora_base_dir(newest_checkpoint).resolve() == run.initial_policy_dir.resolve():
        return None
    return PruneItem("initial_policy", -1, run.initial_policy_dir, freed_by_deleting(run.initial_policy_dir),
                     "the warm-started policy is the start of RL", initial.output_fingerprints.get("policy"))


def apply_prune(plan: PrunePlan) -> PrunePlan:
    """Prune every item of `plan` (tombstone, hide, delete); returns what was pruned (a checkpoint a
    reader holds, `reading_checkpoints`, stays for a later prune). Safe to kill at any point and run
    again: a resumed run's manifests read the tombstones, and `locks.sweep_temporaries` removes a
    hidden leftover."""
    done, kept = [], dict(plan.kept)
    for item in plan.items:
        if prune_path(item.path, item.reason, item.recorded):
            done.append(item)
        else:
            kept.setdefault(item.iteration, "in use by a reader")
    return dataclasses.replace(plan, items=tuple(done), kept=kept)


@contextmanager
def reading_checkpoints(paths: Iterable[str | os.PathLike]) -> Iterator[None]:
    """Hold a shared lock on each checkpoint folder for the block (an evaluation reading them), so
    pruning leaves them alone; FileNotFoundError if one was pruned before the lock was taken."""
    with ExitStack() as stack:
        for path in paths:
            descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            stack.callback(os.close, descriptor)
            fcntl.flock(descriptor, fcntl.LOCK_SH)
            if not os.path.isdir(path) or os.stat(path).st_ino != os.fstat(descriptor).st_ino:
                raise FileNotFoundError(pruned_message(path) or f"checkpoint {path} was removed while being opened")
        yield


def prune_path(path: Path, reason: str, recorded_fingerprint: str | None = None) -> bool:
    """Tombstone `path` with what the manifests recorded of it (`recorded_fingerprint`: as its stage's
    manifest has it, which spares hashing gigabytes; None: hashed now), then remove it; False (and
    nothing done) while a reader holds it."""
    path = Path(path)
    if not path.exists():
        return True
    with _exclusive(path) as free:
        if not free:
            return False
        _tombstone_and_remove(path, reason, recorded_fingerprint)
    return True


@contextmanager
def _exclusive(path: Path) -> Iterator[bool]:
    """Whether no reader holds folder `path` (`reading_checkpoints`); held while the block runs. Files
    (optimizer states) have no readers outside the run's own writer."""
    if not path.is_dir():
        yield True
        return
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(descriptor)


def _tombstone_and_remove(path: Path, reason: str, recorded_fingerprint: str | None) -> None:
    recorded, current = read_tombstone(path), recorded_fingerprint or fingerprint(path)
    if recorded is None or recorded.fingerprint != current:
        stone = Tombstone(fingerprint=current, bytes=output_size(path), reason=reason, pruned_at=time.time())
        write_text_atomic(tombstone_path(path), tombstone_json(stone))
    failpoint("prune:tombstoned")
    hidden = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    os.replace(path, hidden)
    fsync_directory(path.parent)
    failpoint("prune:hidden")
    if hidden.is_dir():
        shutil.rmtree(hidden)
    else:
        hidden.unlink()
