"""Trained objects kept in memory from one iteration's training to the next (trainer.keep_policy_in_memory).

Every iteration still writes its checkpoint and optimizer state (a resumed run, the rollout engines
and the evaluation read them), but the process that wrote them need not read them back: after the
save, `keep` holds the objects under the paths they were saved to and a stamp of those files
(`agent_core.io.manifests.stat_stamp`: names, inodes, sizes, modification times), and the next
iteration's `take` with the same paths gets them instead of loading. What is kept equals what a
reload gives, tensor for tensor (tests/test_resident_policy.py): the weights are written in the
dtype they are trained in (float32, which `load_policy` reads them as), the optimizer state is
written whole, and `keep` puts the modules back into the train/eval modes they had when loaded.

One entry per role ("policy": model, tokenizer, optimizer; "critic": critic, optimizer), so at most
one extra copy of each is held. `take` always removes the entry: training changes the objects in
place, so an iteration that fails (a non-finite update) must not leave a half-trained model for the
next attempt, which then loads from disk as a fresh process would. Any mismatch (other paths, files
rewritten since, other optimizer settings) drops the entry and the caller loads from disk.

Data-parallel workers never use it (each is its own process and only rank 0 saves).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from agent_core.io.manifests import stat_stamp

POLICY = "policy"
CRITIC = "critic"


@dataclass(frozen=True)
class Resident:
    """Objects of one role and what they must match to be used instead of the files."""

    paths: tuple[str, ...]  # what they were saved to: checkpoint directory, optimizer state
    stamp: tuple  # stat_stamp of each path right after the save
    settings: tuple  # what the optimizer was built with (lr, weight decay)
    objects: tuple  # (model, tokenizer, optimizer) or (critic, optimizer)


_lock = threading.Lock()  # a flow may train in a worker thread (trainer.max_staleness >= 1)
_entries: dict[str, Resident] = {}


def _key(paths) -> tuple[str, ...]:
    return tuple(str(Path(p).resolve()) for p in paths)


def _stamp(paths: tuple[str, ...]) -> tuple:
    return tuple(stat_stamp(p) for p in paths)


def keep(role: str, paths, settings: tuple, objects: tuple) -> None:
    """Hold `objects` (just saved to `paths`) for the next `take` of `role`; replaces what was held."""
    paths = _key(paths)
    with _lock:
        _entries[role] = Resident(paths, _stamp(paths), tuple(settings), tuple(objects))


def take(role: str, paths, settings: tuple) -> tuple | None:
    """The objects held for `role` if they were saved to `paths` with `settings` and those files are
    unchanged since; else None. Either way nothing of `role` is held afterwards."""
    if any(p is None for p in paths):
        forget(role)
        return None
    paths = _key(paths)
    with _lock:
        entry = _entries.pop(role, None)
    if entry is None or entry.paths != paths or entry.settings != tuple(settings):
        return None
    if entry.stamp != _stamp(paths) or not all(entry.stamp):  # rewritten or removed since the save
        return None
    return entry.objects


def forget(role: str | None = None) -> None:
    """Drop what is held for `role` (None: every role), e.g. when a flow ends."""
    with _lock:
        if role is None:
            _entries.clear()
        else:
            _entries.pop(role, None)


def held(role: str) -> Resident | None:
    """What is held for `role` (for tests and logs)."""
    with _lock:
        return _entries.get(role)


def training_modes(module: torch.nn.Module) -> dict[str, bool]:
    """The train/eval flag of every submodule (a loaded critic mixes both: see `restore_modes`)."""
    return {name: sub.training for name, sub in module.named_modules()}


def restore_modes(module: torch.nn.Module, modes: dict[str, bool]) -> None:
    """Put back flags from `training_modes`: the trainer leaves a module in one mode throughout
    (`module.train(was_training)`), while a loaded ValueModel is in train mode over an eval-mode
    backbone; a kept module must be what a reload gives, dropout switches included."""
    for name, sub in module.named_modules():
        sub.training = modes.get(name, sub.training)
