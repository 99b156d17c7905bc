"""The multi-rank harness itself: results, exceptions, deaths, hangs, world size 1; fresh
ranks and the pool of reused ones (the suite runs inside ``pooled()``, conftest.py)."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist

import conftest
from gradsync.testing import DistributedError, DistributedTimeout, pooled, run_distributed


def _allreduce_rank(rank: int, world_size: int, scale: float = 1.0) -> dict:
    t = torch.tensor([float(rank)]) * scale
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t}


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_in_rank_order(world_size, fresh):
    out = run_distributed(_allreduce_rank, world_size, scale=2.0, fresh=fresh)
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["world"] == world_size for o in out)
    expected = 2.0 * sum(range(world_size))
    assert all(float(o["sum"]) == expected for o in out)


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom on purpose")
    dist.barrier()  # the other ranks block here; the harness must still stop them
    return rank


@pytest.mark.parametrize("fresh", [True, False])
def test_exception_propagates_with_rank_traceback(fresh):
    with pytest.raises(DistributedError) as err:  # not DistributedTimeout: it did not wait
        run_distributed(_raise_on_rank_1, 3, timeout=60, fresh=fresh)
    assert not isinstance(err.value, DistributedTimeout)
    assert err.value.rank == 1
    assert "KeyError" in err.value.remote_traceback
    assert "boom on purpose" in str(err.value)


def _hang_on_rank_0(rank: int, world_size: int, pid_file: str) -> int:
    if rank == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return rank


def test_timeout_reaps_and_names_hung_rank(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(DistributedTimeout) as err:
        run_distributed(_hang_on_rank_0, 2, str(pid_file), timeout=4)
    assert err.value.ranks == [0]
    assert not _alive(int(pid_file.read_text()))  # reaped, not left sleeping


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
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:  # it went between the two looks
        return False


_LAUNCH = {
    "run_distributed": "from gradsync.testing import run_distributed as launch; "
                       "launch(_record_pid_and_sleep, 2, sys.argv[2], timeout=300)",
    "pooled": "from gradsync.testing import pooled, run_distributed as launch; "
              "pooled().__enter__(); launch(_record_pid_and_sleep, 2, sys.argv[2], timeout=300)",
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


# -- the pool of reused ranks (gradsync.testing.pool) ------------------------------------------
def _pid_and_sum(rank: int, world_size: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return os.getpid(), float(t)


def _fail_on(rank: int, world_size: int, how: str) -> int:
    if rank == 1:
        if how == "raise":
            raise KeyError("boom in a pool")
        if how == "die":
            os._exit(9)
        time.sleep(600)  # hang
    dist.barrier()  # the others wait for rank 1
    return rank


@pytest.mark.parametrize("how", ["raise", "die", "hang"])
def test_a_pool_reports_a_failure_like_fresh_ranks_and_starts_anew(how):
    """A pool runs calls on the same processes; a rank that raises, dies or hangs is reported
    as by fresh ranks (its traceback, its exit code, the ranks still running), the pool's
    processes are stopped (a peer is blocked in a barrier), and the next call runs on new
    ones."""
    from gradsync.testing.pool import RankPool

    pool = RankPool(2)
    try:
        first = pool.run(_pid_and_sum, (), {}, timeout=60)
        assert [s for _, s in first] == [1.0] * 2
        assert [p for p, _ in pool.run(_pid_and_sum, (), {}, timeout=60)] == \
            [p for p, _ in first]  # the same processes
        want = {"raise": DistributedError, "die": DistributedError, "hang": DistributedTimeout}
        with pytest.raises(want[how]) as err:
            pool.run(_fail_on, (how,), {}, timeout=4)
        assert (how == "hang") == isinstance(err.value, DistributedTimeout)  # or it waited
        if how == "raise":
            assert err.value.rank == 1 and "boom in a pool" in err.value.remote_traceback
        elif how == "die":
            assert err.value.rank == 1 and "code 9" in str(err.value)
        else:
            assert err.value.ranks == [0, 1]  # rank 0 waits for it in the barrier
        assert not pool.alive
        assert not any(_alive(p) for p, _ in first)  # stopped, not left in the barrier
    finally:
        pool.close()
    with pooled():  # run_distributed inside pooled() starts a new pool
        again = run_distributed(_pid_and_sum, 2)
    assert [s for _, s in again] == [1.0] * 2
    assert not {p for p, _ in again} & {p for p, _ in first}


def _leave_traces(rank: int, world_size: int) -> dict:
    """Change what a call may change in a process, and report what it found first."""
    import numpy as np

    from gradsync import sparsegrad
    from gradsync.collectives.comm import Comm
    from gradsync.engine import trial as trial_rule
    from gradsync.schedule import costmodel

    found = {"kernels": sparsegrad.cpu_kernels(), "rounds": trial_rule.TRIAL_ROUNDS,
             "profile": costmodel.profile_collectives.__name__,
             "env": os.environ.get("GRADSYNC_POOL_TRACE"), "rand": float(torch.rand(())),
             "np": float(np.random.rand()), "threads": torch.get_num_threads(),
             "groups": len(dist.distributed_c10d._world.pg_map),
             "all_reduce": dist.all_reduce.__name__, "conftest": hasattr(conftest, "_trace"),
             "method": Comm.all_gather_v.__name__}
    sparsegrad.bind(sparsegrad.ACCELERATOR)  # a choice the call makes for itself
    trial_rule.TRIAL_ROUNDS = 99
    costmodel.profile_collectives = lambda *a, **k: None
    os.environ["GRADSYNC_POOL_TRACE"] = "left"
    torch.manual_seed(123)
    np.random.seed(5)
    torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
    # both ranks connected before either returns: the pool tears a call's groups down after it,
    # and a peer still connecting would see "Connection closed by peer" (a fresh clone did)
    dist.barrier(group=dist.new_group())
    dist.all_reduce = lambda *a, **k: None
    conftest._trace = True
    Comm.all_gather_v = lambda *a, **k: None
    return found


def test_a_pooled_call_leaves_no_trace_for_the_next():
    """Module globals (of gradsync, of the test modules and torch.distributed's functions),
    the attributes of gradsync's classes, the environment, the random states, the threads
    and the process groups a call made are put back before the next call: it finds what the
    first one found."""
    from gradsync.testing.pool import RankPool

    pool = RankPool(2)
    try:
        first = pool.run(_leave_traces, (), {}, timeout=60)
        second = pool.run(_leave_traces, (), {}, timeout=60)
    finally:
        pool.close()
    assert first == second
    assert first[0]["groups"] == 1 and first[0]["env"] is None and not first[0]["conftest"]


def _kernels(rank: int, world_size: int) -> object:
    from gradsync import sparsegrad

    return sparsegrad.cpu_kernels()


@pytest.mark.parametrize("fresh", [True, False])
def test_ranks_take_the_callers_kernels(fresh):
    """The kernels the caller chose for its CPU tensors are its ranks' too, fresh or pooled."""
    import dataclasses

    from gradsync import sparsegrad

    for chosen in (sparsegrad.CPU_AS_ACCELERATOR, sparsegrad.CPU,
                   dataclasses.replace(sparsegrad.CPU, segmented=True)):
        with sparsegrad.using(chosen):
            out = run_distributed(_kernels, 2, fresh=fresh)  # the session's pool, or fresh ranks
        assert out == [chosen] * 2


def test_every_launcher_joins_through_a_barrier(monkeypatch):
    """A rank leaves ``join_group`` only after the barrier that follows the group's creation:
    CI once saw rank 1 fail in gloo's connect ("Connection closed by peer") because rank 0,
    whose ``fn`` made no collective, had already torn its group down. All three launchers
    (fresh, pooled, shaped links) join through it."""
    import datetime
    import inspect

    from gradsync.testing import _netem_worker, distributed, pool

    calls: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append("init"))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    distributed.join_group("gloo", "file:///nowhere", 0, 2, datetime.timedelta(seconds=1))
    assert calls == ["init", "barrier"]
    assert inspect.getsource(distributed).count("init_process_group(") == 1  # join_group's
    for module in (pool, _netem_worker):
        source = inspect.getsource(module)
        assert "join_group(" in source and "init_process_group(" not in source, module.__name__
