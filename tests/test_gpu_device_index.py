"""torch.cuda calls that want a device index get one: `bench/gpu_iteration.memory_limit` on
torch.device("cuda") (no index, the current card) passed it to set_per_process_memory_fraction, which
raised ValueError on torch 2.11 on the first GPU run. CPU only: torch.cuda's functions are replaced."""

from __future__ import annotations

import pytest
import torch

from bench import gpu_iteration

GIB = 2**30


class FakeCard:
    total_memory = 80 * GIB


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda's functions memory_limit calls, recording the device argument each one got."""
    calls = []

    def index_only(name):
        def call(*args):
            device = args[-1]
            index = device if isinstance(device, int) else torch.device(device).index
            if index is None and name == "fraction":  # torch's _get_device_index(device), optional=False
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            calls.append((name, *args[:-1], index))
            return FakeCard() if name == "properties" else None
        return call

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", index_only("properties"))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", index_only("fraction"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return calls


@pytest.mark.parametrize("device, index", [(torch.device("cuda"), 3), (torch.device("cuda", 1), 1)])
def test_memory_limit_passes_the_card_index(cuda_calls, device, index):
    with gpu_iteration.memory_limit(device, 24.0):
        assert cuda_calls == [("properties", index), ("fraction", 24 / 80, index)]
    assert cuda_calls[-1] == ("fraction", 1.0, index)  # the limit is lifted on the same card


def test_memory_limit_is_nothing_off_cuda(cuda_calls):
    with gpu_iteration.memory_limit(torch.device("cpu"), 24.0):
        pass
    with gpu_iteration.memory_limit(torch.device("cuda"), None):
        pass
    assert cuda_calls == []


def test_free_bytes_asks_the_fraction_of_the_cards_index(monkeypatch):
    """agent_core/training/memory.device_free_bytes on torch.device("cuda") (no index): the fraction query
    gets the current card's index, as its setter needs."""
    from agent_core.training import memory

    asked = []

    def fraction(device):
        if torch.device(device).index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        asked.append(torch.device(device).index)
        return 0.5

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    assert memory.device_free_bytes(torch.device("cuda")) == 30 * GIB  # min(60 + 12 - 10, 0.5 * 80 - 10)
    assert asked == [2]
