"""Critic checkpoints on disk: build one from a policy checkpoint, save it, load it.

A critic checkpoint is a directory: the backbone's ``save_pretrained`` output (config.json +
safetensors), ``value_head.safetensors`` and ``critic.json``; written to a temporary sibling and
swapped into place like a policy checkpoint (``agent_core.io.checkpoints``).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agent_core.io.checkpoints import load_policy, swap_into_place
from agent_core.training.critic import ValueModel

_HEAD_FILE = "value_head.safetensors"
_META_FILE = "critic.json"
_FORMAT = 1


def build_critic(policy_dir: Path, *, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A fresh critic from the policy checkpoint in `policy_dir` (its weights, a zero value head)."""
    policy, _ = load_policy(Path(policy_dir), dtype=dtype)
    return ValueModel(policy.base_model)


def save_critic(critic: ValueModel, directory: Path) -> Path:
    """Write `critic` to `directory` (replacing it if present) via a temporary sibling and a rename."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        critic.backbone.save_pretrained(staging)
        head = {name: t.detach().cpu().contiguous() for name, t in critic.value_head.state_dict().items()}
        save_file(head, str(staging / _HEAD_FILE))
        meta = {"format": _FORMAT, "hidden_size": critic.value_head.in_features, "head": _HEAD_FILE,
                "alignment": "position t = head(hidden[t-1]); position 0 = 0"}
        (staging / _META_FILE).write_text(json.dumps(meta, indent=2))
        swap_into_place(staging, directory)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_critic(directory: Path, *, dtype: torch.dtype = torch.float32) -> ValueModel:
    """Load a critic written by ``save_critic`` (offline; train/eval mode is the caller's)."""
    from transformers import AutoModel

    directory = Path(directory)
    missing = [name for name in ("config.json", _HEAD_FILE, _META_FILE) if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"critic directory {directory} has no {', '.join(missing)} (written by save_critic?)")
    meta = json.loads((directory / _META_FILE).read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"critic directory {directory} has format {meta.get('format')!r}; this code reads {_FORMAT}")
    critic = ValueModel(AutoModel.from_pretrained(directory, dtype=dtype, local_files_only=True))
    critic.value_head.load_state_dict(load_file(str(directory / _HEAD_FILE)))
    return critic
