"""The parts of a checkpoint directory that both kinds share (a full checkpoint, checkpoints.py; a
LoRA adapter on a base, lora_checkpoints.py): the error type, the files a full checkpoint must
hold, and the swap that puts a staged directory in place. Below both, so neither imports the other
back (checkpoints.py dispatches to lora_checkpoints.py, which checks its base here)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from agent_core.failpoints import failpoint

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class CheckpointError(ValueError):
    """A checkpoint directory is missing or incomplete; the message names it and what is missing."""


def check_full_checkpoint(directory: Path) -> Path:
    """Raise CheckpointError naming the directory and every missing part unless it holds a config,
    weights and a tokenizer (no loading)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any(any(directory.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append(f"weights (one of {', '.join(WEIGHT_PATTERNS)})")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        raise CheckpointError(f"checkpoint directory {directory} is missing {'; '.join(missing)}")
    return directory


def swap_into_place(staging: Path, directory: Path) -> None:
    if not directory.exists():
        staging.rename(directory)
        return
    if not directory.is_dir():
        raise CheckpointError(f"cannot write a checkpoint to {directory}: it exists and is not a directory")
    retired = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
    directory.rename(retired)
    failpoint("checkpoint:old_moved_aside")
    try:
        staging.rename(directory)
    except BaseException:
        retired.rename(directory)  # put the previous checkpoint back rather than leave nothing
        raise
    shutil.rmtree(retired, ignore_errors=True)
