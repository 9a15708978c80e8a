"""Data-parallel PPO steps (agent_core.training.data_parallel) on two real gloo processes.

Two spawned processes on 127.0.0.1 run the same cases as this process does alone (``run_cases``);
a 2-worker step must give the 1-worker parameters and metrics for every loss aggregation mode,
with the ranks holding different numbers of micro-batches (5 of them: 3 and 2; one case gives
rank 1 none at all). Plain SGD with lr 1 makes the parameter change the gradient itself, so a
gradient averaged instead of summed, or not reduced at all, fails. The gradients must travel
through torch's DistributedDataParallel (its comm hook is counted). The processes are spawned once
per module and bounded by timeouts, so a hung collective fails the test instead of blocking it.
"""

from __future__ import annotations

import math
import socket
import time
import weakref
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from agent_core.progress import reporting_to
from agent_core.training.batches import make_micro_batches
from agent_core.training.critic import value_model_from_policy
from agent_core.training.data_parallel import DataParallel
from agent_core.training.safety import is_nonfinite_skip
from agent_core.training.trainer import ppo_update, train_iteration
from test_trainer import ITERATION, PAD, UPDATE, full_steps, parameters, random_steps, tiny_llama

WORLD_SIZE = 2
SEED = 20  # 6 sequences of 5..10 tokens: 5 micro-batches of <= 12 tokens
MICRO_BATCH_TOKENS = 12
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
METRICS = ("loss", "pg_loss", "vf_loss", "entropy", "kl", "clipfrac", "grad_norm", "tokens", "skipped")
SPAWN_TIMEOUT_S = 120.0  # everything the two processes do; a hang fails the module's tests


class _CountMicroBatches:
    """A progress reporter: the trainer reports each policy micro-batch it ran on this rank."""

    def __init__(self):
        self.done = 0

    def update(self, advance, total, stats):
        self.done += advance

    def close(self):
        pass


def _metrics(result) -> dict:
    return {name: value for name, value in asdict(result).items() if name in METRICS}


def _ppo_case(agg_mode: str, steps, dp) -> dict:
    model = tiny_llama(0)
    settings = replace(UPDATE, agg_mode=agg_mode, micro_batch_tokens=MICRO_BATCH_TOKENS, entropy_coef=0.01,
                       kl_coef=0.1 if agg_mode == "seq-mean-token-sum-norm" else 0.0)
    counter = _CountMicroBatches()
    with reporting_to(counter):
        result = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), steps, settings, pad_id=PAD, dp=dp)
    return {"params": parameters(model), "metrics": _metrics(result), "micro_batches": counter.done}


def _iteration_case(dp) -> dict:
    """Two mini-batches with a critic, recomputed old log-probs and gradient clipping.

    SGD, not Adam: Adam divides by sqrt(v) + eps, which turns the rounding of a different
    summation order in a near-zero gradient element (the critic's zero-initialised head makes its
    backbone's first gradients tiny) into parameter differences above the tolerance.
    """
    model = tiny_llama(0)
    critic = value_model_from_policy(model)
    settings = replace(ITERATION, mini_batches=2, micro_batch_tokens=MICRO_BATCH_TOKENS, recompute_old_logprobs=True,
                       agg_mode="seq-mean-token-mean", entropy_coef=0.01)
    results = train_iteration(model, torch.optim.SGD(model.parameters(), lr=0.1), full_steps(SEED), settings,
                              pad_id=PAD, critic=critic, critic_optimizer=torch.optim.SGD(critic.parameters(), lr=0.1),
                              seed=3, dp=dp)
    return {"params": parameters(model), "critic": parameters(critic), "metrics": [_metrics(r) for r in results]}


def run_cases(dp: DataParallel | None) -> dict:
    """What is compared between one process (dp None) and each of two ranks."""
    cases = {}
    for agg_mode in AGG_MODES:  # token-mean without ref log-probs: the approx-KL metric path
        steps = random_steps(SEED, 6) if agg_mode == "token-mean" else full_steps(SEED)
        cases[agg_mode] = _ppo_case(agg_mode, steps, dp)
    cases["one sequence"] = _ppo_case("token-mean", random_steps(SEED, 1), dp)  # rank 1 runs no micro-batch
    cases["iteration"] = _iteration_case(dp)
    return cases


def _skip_case(dp: DataParallel) -> dict:
    """Rank 1's copy of the model gives nan log-probs; rank 0's is fine, yet both must skip."""
    model = tiny_llama(0)
    if dp.rank == 1:
        with torch.no_grad():
            model.lm_head.weight[0, 0] = float("nan")
    before = parameters(model)
    result = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), full_steps(SEED),
                        replace(UPDATE, micro_batch_tokens=MICRO_BATCH_TOKENS), pad_id=PAD, dp=dp)
    unchanged = all(torch.allclose(p.detach(), before[name], rtol=0, atol=0, equal_nan=True)
                    for name, p in model.named_parameters())
    return {"skipped": result.skipped, "reason": result.skip_reason, "unchanged": unchanged,
            "grads_cleared": all(p.grad is None for p in model.parameters())}


class _HandMade(torch.nn.Module):
    """Parameters with hand-set gradients; a forward that reaches only one of them."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Parameter(torch.zeros(3))
        self.only_rank0 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))  # its own dtype bucket
        self.unused = torch.nn.Parameter(torch.zeros(4))
        self.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)

    def forward(self, input_ids, attention_mask):
        return self.shared.sum() * input_ids.sum()


def _collective_case(dp: DataParallel) -> dict:
    """sum_floats, any_rank and sum_gradients on hand-made values."""
    module = _HandMade()
    module.shared.grad = torch.full((3,), float(dp.rank + 1))  # 1 and 2: sum 3
    module.only_rank0.grad = torch.tensor([1.5, -2.0], dtype=torch.float64) if dp.rank == 0 else None
    # unused: no grad on any rank, stays None; frozen: not trainable, DDP leaves it alone
    dp.sum_gradients(module)
    return {"sum_floats": dp.sum_floats([float(dp.rank), 1.0, 0.25]), "any_rank1": dp.any_rank(dp.rank == 1),
            "any_none": dp.any_rank(False), "shared": module.shared.grad.tolist(),
            "only_rank0": module.only_rank0.grad.tolist(), "unused_is_none": module.unused.grad is None,
            "frozen_is_none": module.frozen.grad is None, "still_training": module.training,
            "shard": dp.shard(list(range(7)))}


def _ddp_case(dp: DataParallel) -> dict:
    """One data-parallel PPO step with DDP's comm hook counted: its buckets carry every gradient."""
    buckets, wrappers = [], []
    register = DistributedDataParallel.register_comm_hook

    def counting_register(ddp, state, hook):
        wrappers.append(weakref.ref(ddp))

        def counted(state, bucket):
            buckets.append(bucket.buffer().numel())
            return hook(state, bucket)
        return register(ddp, state, counted)

    model = tiny_llama(0)
    DistributedDataParallel.register_comm_hook = counting_register
    try:
        result = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), full_steps(SEED),
                            replace(UPDATE, micro_batch_tokens=MICRO_BATCH_TOKENS), pad_id=PAD, dp=dp)
    finally:
        DistributedDataParallel.register_comm_hook = register
    return {"skipped": result.skipped, "bucket_elements": sum(buckets), "buckets": len(buckets),
            "trainable_elements": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "wrappers": len(wrappers), "wrappers_freed": all(w() is None for w in wrappers)}


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank (module level, so spawn can pickle it): every case, its results saved for the test."""
    torch.set_num_threads(1)  # two ranks on a small machine: no oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        dp = DataParallel.from_process_group()
        out = {"dp": (dp.rank, dp.world_size), "cases": run_cases(dp), "skip": _skip_case(dp),
               "collectives": _collective_case(dp), "ddp": _ddp_case(dp)}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("data_parallel")
    context = mp.start_processes(_worker, args=(WORLD_SIZE, _free_port(), str(out_dir)), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=1.0):  # raises when a rank failed, with its traceback
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD_SIZE} ranks did not finish in {SPAWN_TIMEOUT_S:.0f} s (a hung collective?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def single() -> dict:
    return run_cases(None)


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def assert_same_metrics(a: dict, b: dict) -> None:
    for name in METRICS:
        if isinstance(a[name], float) and math.isnan(a[name]):
            assert math.isnan(b[name]), name
        else:
            assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("case", [*AGG_MODES, "one sequence"])
def test_two_workers_take_the_one_worker_step(ranks, single, case):
    one = single[case]
    assert not one["metrics"]["skipped"] and one["micro_batches"] >= 1
    for rank in ranks:
        assert_same_params(one["params"], rank["cases"][case]["params"])
        assert_same_metrics(one["metrics"], rank["cases"][case]["metrics"])
    # both ranks applied the same summed gradient: bit-identical weights
    assert all(torch.equal(ranks[0]["cases"][case]["params"][n], ranks[1]["cases"][case]["params"][n])
               for n in one["params"])


def test_each_rank_runs_only_its_share_of_the_micro_batches(ranks, single):
    total = len(make_micro_batches(full_steps(SEED), max_tokens=MICRO_BATCH_TOKENS, pad_id=PAD))
    assert total == 5
    for agg_mode in AGG_MODES:
        assert single[agg_mode]["micro_batches"] == total
        assert [r["cases"][agg_mode]["micro_batches"] for r in ranks] == [3, 2]  # round robin, unequal shares
    assert [r["cases"]["one sequence"]["micro_batches"] for r in ranks] == [1, 0]
    assert [r["dp"] for r in ranks] == [(0, 2), (1, 2)]


def test_a_train_iteration_with_a_critic_matches_one_worker(ranks, single):
    one = single["iteration"]
    assert len(one["metrics"]) == 2 and not any(m["skipped"] for m in one["metrics"])
    assert all(math.isfinite(m["vf_loss"]) for m in one["metrics"])
    for rank in ranks:
        assert_same_params(one["params"], rank["cases"]["iteration"]["params"])
        assert_same_params(one["critic"], rank["cases"]["iteration"]["critic"])
        for a, b in zip(one["metrics"], rank["cases"]["iteration"]["metrics"], strict=True):
            assert_same_metrics(a, b)


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(ranks):
    local, remote = ranks[1]["skip"], ranks[0]["skip"]
    assert local["skipped"] and "log-probs" in local["reason"] and is_nonfinite_skip(local["reason"])
    assert remote["skipped"] and "another worker" in remote["reason"] and is_nonfinite_skip(remote["reason"])
    assert remote["unchanged"] and local["unchanged"]  # rank 0's finite gradient was not stepped either
    assert remote["grads_cleared"] and local["grads_cleared"]


def test_collectives_sum_over_ranks(ranks):
    for rank, out in enumerate(r["collectives"] for r in ranks):
        assert out["sum_floats"] == [1.0, 2.0, 0.5]
        assert out["any_rank1"] is True and out["any_none"] is False
        assert out["shared"] == [3.0, 3.0, 3.0]
        assert out["only_rank0"] == [1.5, -2.0]  # a rank without the grad joins with zeros
        assert out["unused_is_none"]  # no grad anywhere: None, so the optimizer skips it as in one process
        assert out["frozen_is_none"] and out["still_training"]
        assert out["shard"] == [rank, rank + 2, rank + 4] + ([rank + 6] if rank == 0 else [])


def test_the_gradients_are_summed_by_torch_distributed_data_parallel(ranks):
    for out in (r["ddp"] for r in ranks):
        assert not out["skipped"]
        assert out["buckets"] >= 1  # DDP's reducer ran the comm hook: the sync went through DDP
        assert out["bucket_elements"] == out["trainable_elements"]  # every gradient, once, in one step
        assert out["wrappers"] == 1 and out["wrappers_freed"]  # one DDP for the step's sync, then gone


def test_one_worker_data_parallel_is_the_single_process_step():
    steps = random_steps(SEED, 6)
    deltas = []
    for dp in (None, DataParallel(0, 1)):  # world size 1 needs no process group: no collective is made
        model = tiny_llama(0)
        ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), steps,
                   replace(UPDATE, micro_batch_tokens=MICRO_BATCH_TOKENS), pad_id=PAD, dp=dp)
        deltas.append(parameters(model))
    assert all(torch.equal(deltas[0][n], deltas[1][n]) for n in deltas[0])


def test_data_parallel_needs_a_process_group_and_a_valid_rank():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DataParallel.from_process_group()
    with pytest.raises(ValueError, match="rank 2 of 2"):
        DataParallel(2, 2)
    assert DataParallel(1, 3).shard(range(7)) == [1, 4]
