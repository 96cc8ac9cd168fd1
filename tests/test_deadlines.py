"""Deadlines per phase: a fence leaves over gloo with its own deadline even on a group bound to a device, the group's
collective deadline is set after start-up (16 ranks that meet late still start), and the stall watch ends a silent
rank and only that one."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.utilities.distributed import _sync_ddp

from hslite.parallel.deadlines import Deadlines, fence, fence_group
from hslite.parallel.host_reduce import max_over_ranks
from hslite.parallel.ranks.stall_watch import Heartbeat, StallWatch, beat_path, same_job_here, stalled_path
from hslite.recipe.config import load_config
from hslite.recipe.schema import valid_keys

LONG = datetime.timedelta(seconds=120)  # the default group's deadline: the fence must not wait for it


def _bound_rank(rank: int, world: int, store_path: str, out_dir: str, late: int) -> None:
    """A rank of a gloo group bound to a device, as Lightning binds its group to the rank's GPU."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=LONG)
    # torch refuses to make a group under a default group bound to the CPU (on GPUs the fence group is made under the
    # binding, and the GPU smoke checks that): the fence group is made first, then the default group bound.
    fence_group()
    dist.distributed_c10d._get_default_group().bound_device_id = torch.device("cpu", 0)

    def bound_barrier(*args, **kwargs):  # torch's rule: a bound group's barrier goes over the bound device (NCCL)
        raise AssertionError("a barrier on the bound default group: on GPUs an NCCL all-reduce without its deadline")

    dist.barrier = bound_barrier
    outcome = {"backend": dist.get_backend(fence_group())}
    fence(30)
    outcome["first"] = "passed"
    outcome["max"] = max_over_ranks(torch.tensor([float(rank), -float(rank)])).tolist()
    try:  # what timing and usage figures went through before: Lightning's reduce, which opens with a barrier
        _sync_ddp(torch.tensor([float(rank)]), reduce_op="max")
        outcome["lightning_reduce"] = "no barrier"
    except AssertionError:
        outcome["lightning_reduce"] = "barrier on the bound group"
    start = time.monotonic()
    try:
        if rank != late:  # this rank works alone past the fence's deadline
            fence(3)
        else:
            time.sleep(8)
        outcome["second"] = "passed"
    except RuntimeError as err:
        outcome["second"] = str(err).strip().splitlines()[0]
    outcome["waited"] = time.monotonic() - start
    Path(out_dir, f"rank{rank}.txt").write_text(repr(outcome))
    os._exit(0)  # the group is left broken on purpose; no destroy, no teardown collective


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_fence_on_a_bound_group_goes_over_gloo_and_keeps_its_own_deadline(tmp_path):
    mp.start_processes(_bound_rank, args=(2, str(tmp_path / "store"), str(tmp_path), 1), nprocs=2, start_method="spawn")
    outcomes = [eval((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)]  # noqa: S307 - our own repr
    assert [o["backend"] for o in outcomes] == ["gloo", "gloo"]
    assert [o["first"] for o in outcomes] == ["passed", "passed"]
    assert [o["max"] for o in outcomes] == [[1.0, 0.0], [1.0, 0.0]]  # host figures reduced with no barrier
    assert [o["lightning_reduce"] for o in outcomes] == ["barrier on the bound group"] * 2
    # Rank 0 waited the fence's 3 s, not the group's 120, and says which rank did not come.
    assert 2.5 <= outcomes[0]["waited"] < 30, outcomes
    assert "1" in outcomes[0]["second"] and "monitoredBarrier" in outcomes[0]["second"], outcomes


def test_fences_need_no_group_in_a_process_of_one():
    fence(0.001)  # no process group: nothing to wait for, and nothing raised


# ------------------------------------------------------------------------------ start-up has its own deadline
STARTUP_RANKS = 16


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sixteen_spawned_ranks_meeting_after_the_collective_deadline_still_start(tmp_path):
    script = Path(__file__).parent / "_dist_scripts" / "late_ranks.py"
    done = subprocess.run(
        [sys.executable, str(script), str(STARTUP_RANKS), str(tmp_path)], capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = (tmp_path / "result.txt").read_text().split()
    spread, deadline, trained = float(seen[0]), float(seen[1]), int(seen[2])
    assert spread > deadline  # the last rank came after the collective deadline had passed for the first
    assert trained == STARTUP_RANKS
    assert seen[3] == f"{deadline:.0f}"  # then every rank's group took the collective deadline, not start-up's


# ------------------------------------------------------------------------------ the stall watch
def _beat(folder: Path, rank: int, pid: int, count: int) -> None:
    beat_path(folder, rank).write_text(f"{pid} {count} {socket.gethostname()}")


def test_the_stall_watch_ends_the_silent_child_and_spares_the_beating_one(tmp_path):
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    beating = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = StallWatch(tmp_path, stall_seconds=30)
        for t in range(0, 40, 5):
            _beat(tmp_path, 0, beating.pid, t)  # a new beat each look
            if t == 0:
                _beat(tmp_path, 1, silent.pid, 1)  # one beat, then silence
            watch.check(float(t))
        assert watch.stalled == {1: 35.0}
        assert json.loads(stalled_path(tmp_path, 1).read_text()) == {"silent_seconds": 35.0}  # for launched ranks
        assert silent.wait(timeout=10) == -9
        assert beating.poll() is None
    finally:
        for process in (silent, beating):
            process.kill()
            process.wait()


def test_the_stall_watch_never_kills_a_process_that_is_not_its_child(tmp_path):
    _beat(tmp_path, 0, os.getppid(), 1)  # a stale beat naming a pid the watch did not spawn
    watch = StallWatch(tmp_path, stall_seconds=1)
    watch.check(0.0)
    watch.check(5.0)
    assert watch.stalled == {}


def test_a_launched_rank_ends_only_ranks_of_its_own_job_on_its_own_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # read from /proc: what this process was started with counts
    job = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29411", "TORCHELASTIC_RUN_ID": "run-a"}
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=job)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**job, "MASTER_PORT": "1"})
    try:
        me = subprocess.run(
            [sys.executable, "-c", f"from hslite.parallel.ranks.stall_watch import same_job_here as s; import socket; "
             f"h = socket.gethostname(); print(s({ours.pid}, h), s({other.pid}, h), s({ours.pid}, 'elsewhere'))"],
            env=job, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert me == ["True", "False", "False"]
        assert not same_job_here(ours.pid, socket.gethostname())  # this test process belongs to no launched job
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()


def test_a_heartbeat_changes_every_second_and_its_file_goes_when_it_stops(tmp_path):
    heart = Heartbeat(tmp_path, 3)
    heart.start()
    first = beat_path(tmp_path, 3).read_text() if _wait_for(beat_path(tmp_path, 3)) else None
    time.sleep(1.5)
    assert beat_path(tmp_path, 3).read_text() != first
    assert first is not None and first.split()[0] == str(os.getpid())
    heart.stop()
    assert not beat_path(tmp_path, 3).exists()


def _wait_for(path: Path, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.01)
    return path.exists()


# ------------------------------------------------------------------------------ the keys a team sets
def test_every_deadline_is_a_recipe_key_with_the_library_default():
    keys = [k for k in valid_keys() if k.startswith("parallel.deadlines.")]
    assert keys == [f"parallel.deadlines.{phase}" for phase in ("collective", "startup", "fence", "stall")]
    cfg = load_config("quickstart", ["parallel.deadlines.stall=12"])
    assert vars(cfg.parallel.deadlines) == {**vars(Deadlines()), "stall": 12.0}


def test_recipes_keys_says_each_deadline_its_default_and_what_happens_when_it_passes(capsys):
    from hslite.cli import main

    assert main(["recipes", "--keys"]) == 0
    lines = {line.split("=", 1)[0]: line for line in capsys.readouterr().out.splitlines()}
    for phase, default in vars(Deadlines()).items():
        line = lines[f"parallel.deadlines.{phase}"]
        assert line.startswith(f"parallel.deadlines.{phase}={default}  # "), line
        assert "passed:" in line or "ended and named" in line, line


def test_a_strategy_given_one_timeout_says_it_waits_per_phase():
    from hslite.errors import ConfigError
    from hslite.strategies import FencedDDPStrategy

    with pytest.raises(ConfigError, match=r"waits per phase: pass deadlines=Deadlines\(startup=.*instead of timeout="):
        FencedDDPStrategy(timeout=datetime.timedelta(seconds=60))
    assert FencedDDPStrategy(deadlines=Deadlines(startup=42))._timeout == datetime.timedelta(seconds=42)
