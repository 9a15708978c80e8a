"""Where a run's models live: the `device` setting (auto, cpu, cuda, cuda:N) resolved to a torch device.

One function decides it for every model of a run in this process (the trained policy, the reference
scoring, the critic, the hf engine), so they never disagree. It is pure apart from asking
torch.cuda whether and how many devices there are; tests monkeypatch those two queries.
"""

from __future__ import annotations

import re

import torch

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
_CUDA = re.compile(r"^cuda(?::(\d+))?$")


class DeviceError(ValueError):
    """A `device` setting this machine cannot give; the message says which and what to set instead."""


def resolve_device(setting: str | torch.device | None = "auto") -> torch.device:
    """auto (or None): cuda when torch.cuda.is_available(), else cpu; cpu; cuda; cuda:N. A CUDA
    device this machine does not have raises DeviceError (one line: what, and what to set instead)."""
    if isinstance(setting, torch.device):
        setting = str(setting)
    setting = (setting or "auto").strip().lower()
    if setting == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if setting == "cpu":
        return torch.device("cpu")
    match = _CUDA.match(setting)
    if match is None:
        raise DeviceError(f"device={setting!r} is not a device: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"device={setting}: this machine has no CUDA device (torch.cuda.is_available() is False); "
                          "set device: auto or cpu")
    index = int(match.group(1)) if match.group(1) is not None else None
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise DeviceError(f"device={setting}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
                          "set device: cuda:0, cuda or auto")
    return torch.device("cuda", index) if index is not None else torch.device("cuda")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same place ("cuda" is the current CUDA device, like "cuda:<current>")."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
