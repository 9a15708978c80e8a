"""Trained objects kept in memory from one iteration's training to the next (runtime.keep_policy_in_memory).

Every iteration still writes its checkpoint and optimizer state; after the save, `keep` holds the objects with
a stamp of those files and the next iteration's `take` with the same paths gets them instead of loading (equal
to a reload, tensor for tensor). `take` always removes the entry; any mismatch drops it (the caller loads from
disk). The saved policy is also `offer`ed, so an hf engine in this process can borrow it (`lend`).
Design notes: docs/architecture.md §11 (agent_core/training/resident.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from agent_core.devices import same_device
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


@dataclass(frozen=True)
class Offer:
    """A saved policy an engine may borrow: its checkpoint directory, that directory's stamp, the objects."""

    path: str
    stamp: tuple
    model: torch.nn.Module
    tokenizer: object


class Lease:
    """A borrowed policy module: `model`, `tokenizer`; `release()` (idempotent) gives it back."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self._open = model, tokenizer, True

    def release(self) -> None:
        with _lock:
            if self._open:
                self._open = False
                _lent[id(self.model)] -= 1
                if not _lent[id(self.model)]:
                    del _lent[id(self.model)]


_lock = threading.Lock()  # a flow may train in a worker thread (runtime.max_staleness >= 1)
_entries: dict[str, Resident] = {}
_offer: Offer | None = None  # the one policy engines may borrow
_lent: dict[int, int] = {}  # id(module) -> open leases


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
    global _offer
    with _lock:
        entry = _entries.pop(role, None)
        if entry is not None and _offer is not None and _offer.model is entry.objects[0]:
            _offer = None  # about to be trained in place: no engine may borrow it from now on
        lent = entry is not None and id(entry.objects[0]) in _lent
    if entry is None or lent or entry.paths != paths or entry.settings != tuple(settings):
        return None
    if entry.stamp != _stamp(paths) or not all(entry.stamp):  # rewritten or removed since the save
        return None
    return entry.objects


def forget(role: str | None = None) -> None:
    """Drop what is held for `role` (None: every role, and the offer), e.g. when a flow ends."""
    global _offer
    with _lock:
        if role is None:
            _entries.clear()
            _offer = None
        else:
            dropped = _entries.pop(role, None)
            if dropped is not None and _offer is not None and _offer.model is dropped.objects[0]:
                _offer = None


def offer(path, model, tokenizer) -> None:
    """Let engines borrow `model` (just saved to the checkpoint directory `path`) until it is taken
    for training or forgotten; replaces an earlier offer."""
    global _offer
    key = _key([path])[0]
    with _lock:
        _offer = Offer(key, _stamp((key,)), model, tokenizer)


def lend(path, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Lease | None:
    """A lease on the offered module if it was saved to `path`, that directory is unchanged since, it
    lives on `device` and its parameters are `dtype` (None: any); else None (the caller loads the checkpoint)."""
    key = _key([path])[0]
    with _lock:
        found = _offer
        if found is None or found.path != key or found.stamp != _stamp((key,)) or not all(found.stamp):
            return None
        if device is not None and not _on(found.model, device):
            return None
        if dtype is not None and next(found.model.parameters()).dtype != dtype:
            return None
        _lent[id(found.model)] = _lent.get(id(found.model), 0) + 1
        return Lease(found.model, found.tokenizer)


def _on(model: torch.nn.Module, device: torch.device) -> bool:
    return same_device(next(model.parameters()).device, torch.device(device))


def lent() -> int:
    """Open leases (for tests and logs)."""
    with _lock:
        return sum(_lent.values())


def offered() -> Offer | None:
    """What engines may borrow now (for tests and logs)."""
    with _lock:
        return _offer


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
