"""The optimizer's state between iterations, so Adam's moments carry over like in one long run."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(optimizer.state_dict(), tmp)
    os.replace(tmp, path)
    return path


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> bool:
    """Restore the state if `path` exists; return whether it did."""
    if not path.is_file():
        return False
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return True
