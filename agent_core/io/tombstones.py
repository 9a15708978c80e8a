"""Tombstones: what a pruned checkpoint or optimizer state leaves behind (agent_core/io/retention.py).

`<name>.pruned.json` beside the pruned path records the fingerprint and size the path had, so a stage
manifest that names it as an input or output still matches on resume (manifests.fingerprint reads
it) and a reader that needs the files is told they were pruned, not that the run is damaged.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

SUFFIX = ".pruned.json"


@dataclass(frozen=True)
class Tombstone:
    fingerprint: str  # manifests.fingerprint of the path before it was pruned
    bytes: int  # manifests.output_size of it
    reason: str  # the retention rule that let it go, e.g. "checkpoints.keep_last=1"
    pruned_at: float


def tombstone_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def read_tombstone(path: str | os.PathLike) -> Tombstone | None:
    """The tombstone of `path`, if `path` was pruned (a damaged tombstone reads as none)."""
    try:
        return Tombstone(**json.loads(tombstone_path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def tombstone_json(tombstone: Tombstone) -> str:
    return json.dumps(asdict(tombstone), indent=1, sort_keys=True)


def pruned_message(path: str | os.PathLike) -> str | None:
    """One line saying `path` was pruned by retention and how to keep such files, or None."""
    found = read_tombstone(path)
    if found is None or Path(path).exists():
        return None
    return (f"{path} was pruned by checkpoint retention ({found.reason}); set checkpoints.keep_all: true "
            "(or keep_last / keep_every) to keep such files")
