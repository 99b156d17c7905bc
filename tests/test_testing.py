"""The multi-rank harness itself: results, exceptions, deaths, hangs, world size 1."""

from __future__ import annotations

import contextlib
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


def _record_pid_and_sleep(rank: int, world_size: int, folder: str) -> None:
    with open(os.path.join(folder, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
        return f.read().split(") ", 1)[1][0] != "Z"


_LAUNCH = {
    "run_distributed": "from gradsync.testing import run_distributed as launch; "
                       "launch(_record_pid_and_sleep, 2, sys.argv[2], timeout=300)",
    "run_shaped": "from gradsync.testing.netem import run_shaped as launch; "
                  "launch(_record_pid_and_sleep, 2, sys.argv[2], bandwidth='100mbit', "
                  "timeout=300, fallback=False)",
}


@pytest.mark.skipif(not os.path.exists("/proc"), reason="reads /proc")
@pytest.mark.parametrize("how", sorted(_LAUNCH))
def test_ranks_exit_when_their_launcher_is_killed(tmp_path, how):
    """SIGKILL to the launcher alone (no finally, no cleanup): its ranks — forked from the
    server process (``run_distributed``), or its children re-parented to init by its death
    (``run_shaped``, one ``ip netns exec`` process per rank) — notice within seconds and
    exit."""
    import signal
    import subprocess
    import sys

    from gradsync.testing import netem

    if how == "run_shaped" and netem.netem_available() is not None:
        pytest.skip(f"shaped links: {netem.netem_available()}")
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from test_testing import _record_pid_and_sleep; " + _LAUNCH[how])
    launcher = subprocess.Popen([sys.executable, "-c", code, here, str(tmp_path)])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            assert launcher.poll() is None, "the launcher ended early"
            time.sleep(0.1)
        time.sleep(0.2)  # the pid files are written whole
        pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "ranks outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids:  # a failed run must not leave them sleeping
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if how == "run_shaped":
            netem.cleanup_stale()  # the killed launcher's namespaces
