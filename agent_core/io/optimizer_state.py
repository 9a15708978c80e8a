"""The optimizer's state between iterations, so Adam's moments carry over like in one long run. Written
only where the disk holds it plus the run's margin (io/disk_budget.py), atomically."""

from __future__ import annotations

from pathlib import Path

import torch

from agent_core.io.atomic import atomic_file
from agent_core.io.disk_budget import ensure_room, optimizer_bytes


def save_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> Path:
    """Write the state atomically (temporary file, fsync, rename): a resumed run never loads half of it.
    Too little free disk for it and the margin raises `disk_budget.DiskBudgetError` first."""
    ensure_room(path, optimizer_bytes(optimizer), "optimizer state")
    with atomic_file(path, failpoint_prefix="save_optimizer") as sink:
        torch.save(optimizer.state_dict(), sink)
    return path


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> bool:
    """Restore the state if `path` exists; return whether it did."""
    if not path.is_file():
        return False
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return True
