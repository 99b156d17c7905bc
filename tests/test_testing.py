"""The multi-rank harness itself: results, exceptions, deaths, hangs, world size 1."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from gradsync.testing import DistributedError, DistributedTimeout, run_distributed


def _allreduce_rank(rank: int, world_size: int, scale: float = 1.0) -> dict:
    t = torch.tensor([float(rank)]) * scale
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_in_rank_order(world_size):
    out = run_distributed(_allreduce_rank, world_size, scale=2.0)
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["world"] == world_size for o in out)
    expected = 2.0 * sum(range(world_size))
    assert all(float(o["sum"]) == expected for o in out)


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom on purpose")
    dist.barrier()  # the other ranks block here; the harness must still stop them
    return rank


def test_exception_propagates_with_rank_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as err:
        run_distributed(_raise_on_rank_1, 3, timeout=60)
    assert err.value.rank == 1
    assert "KeyError" in err.value.remote_traceback
    assert "boom on purpose" in str(err.value)
    assert time.monotonic() - t0 < 30  # did not wait for the full timeout


def _hang_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank


def test_timeout_reaps_and_names_hung_rank():
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout) as err:
        run_distributed(_hang_on_rank_0, 2, timeout=4)
    assert err.value.ranks == [0]
    assert time.monotonic() - t0 < 20


def _die_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def test_silent_death_is_reported():
    with pytest.raises(DistributedError) as err:
        run_distributed(_die_on_rank_1, 2, timeout=30)
    assert err.value.rank == 1
    assert "code 7" in str(err.value)


def test_bad_arguments():
    with pytest.raises(ValueError):
        run_distributed(_allreduce_rank, 0)
    with pytest.raises(ValueError):
        run_distributed(_allreduce_rank, 1, timeout=0)
