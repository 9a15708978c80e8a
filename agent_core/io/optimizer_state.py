"""The optimizer's state between iterations, so Adam's moments carry over like in one long run."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch

from agent_core.failpoints import failpoint


def save_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> Path:
    """Write the state atomically (temporary file, fsync, rename): a resumed run never loads half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as sink:
            torch.save(optimizer.state_dict(), sink)
            sink.flush()
            os.fsync(sink.fileno())
        failpoint("save_optimizer:temp_written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> bool:
    """Restore the state if `path` exists; return whether it did."""
    if not path.is_file():
        return False
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return True
