"""The hang zoo for real: each fault starts 4 gloo/CPU ranks, gets stuck, and py-spy shows every rank where
the fault leaves it. Stacks come from the real `py-spy dump --pid` (no fixtures); ~10-20 s per fault."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from hangdx.playbooks import verdict
from hangdx.zoo.launch import DEFAULT_FAULT, FAULTS, ZooJob, group_members, pid_alive

CATEGORIES = set(verdict.CATEGORIES)

# fault -> rank -> strings that rank's py-spy dump must contain (None: the process must be gone).
EXPECTED_STACKS: dict[str, dict[int, tuple[str, ...] | None]] = {
    "skip_collective": {
        0: ("all_reduce", "log_metrics"),
        1: ("broadcast", "should_stop"),
        2: ("all_reduce", "log_metrics"),
        3: ("all_reduce", "log_metrics"),
    },
    "uneven_data": {
        0: ("all_reduce", "sync_gradients"),
        1: ("all_reduce", "sync_gradients"),
        2: ("all_reduce", "sync_gradients"),
        3: ("barrier", "finish_epoch"),
    },
    "op_mismatch": {
        0: ("all_reduce", "reduce_gradients"),
        1: ("all_reduce", "reduce_gradients"),
        2: ("broadcast", "reduce_gradients"),
        3: ("all_reduce", "reduce_gradients"),
    },
    "rank_killed": {
        0: ("all_reduce", "sync_gradients"),
        1: ("all_reduce", "sync_gradients"),
        2: None,
        3: ("all_reduce", "sync_gradients"),
    },
    "dataloader_hang": {
        0: ("all_reduce", "sync_gradients"),
        1: ("torch/utils/data/dataloader.py", "__next__"),
        2: ("all_reduce", "sync_gradients"),
        3: ("all_reduce", "sync_gradients"),
    },
    "io_hang": {
        0: ("barrier", "run_io_hang"),
        1: ("barrier", "run_io_hang"),
        2: ("barrier", "run_io_hang"),
        3: ("load_checkpoint", "torch/serialization.py"),
    },
    "lock_deadlock": {
        0: ("_rotate_if_large", '"metrics-flusher"', "_flush_loop"),
        1: ("all_reduce", "sync_gradients"),
        2: ("all_reduce", "sync_gradients"),
        3: ("all_reduce", "sync_gradients"),
    },
    "p2p_deadlock": {
        0: ("recv", "exchange_boundary"),
        1: ("recv", "exchange_boundary"),
        2: ("all_reduce", "sync_gradients"),
        3: ("all_reduce", "sync_gradients"),
    },
    "ddp_unused": {
        0: ("Tensor.backward", "_engine_run_backward"),
        1: ("barrier", "shutdown"),
        2: ("Tensor.backward", "_engine_run_backward"),
        3: ("Tensor.backward", "_engine_run_backward"),
    },
    "late_join": {
        0: ("init_process_group",),
        1: ("init_process_group",),
        2: ("init_process_group",),
        3: ("wait_for_dataset_download",),
    },
}


def pyspy_dump(pid: int) -> str:
    """`py-spy dump --pid`, retried: an attach can fail now and then while the target is busy."""
    out = ""
    for _ in range(3):
        proc = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
        )
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 and "Thread" in proc.stdout:
            return proc.stdout
        time.sleep(0.5)
    return out


def main_thread(dump: str) -> str:
    """The MainThread block of a py-spy dump (other threads are feeders, flushers, ...)."""
    blocks = dump.split("\nThread ")
    for block in blocks:
        if '"MainThread"' in block.splitlines()[0]:
            return block
    return dump


def own_frames(dump: str) -> list[str]:
    """The main thread's frames in the zoo program itself (library frames may wiggle inside a wait loop)."""
    return [line.strip() for line in main_thread(dump).splitlines() if "hangdx/zoo/job.py" in line]


def test_faults_table_matches_contract() -> None:
    assert list(FAULTS)[0] == DEFAULT_FAULT == "skip_collective"
    assert list(FAULTS) == [*EXPECTED_STACKS, "straggler"]
    for name, fault in FAULTS.items():
        assert fault.name == name
        assert fault.category in CATEGORIES
        assert fault.culprit_ranks and all(0 <= r < 4 for r in fault.culprit_ranks)
        assert fault.hangs == (name != "straggler")
    assert FAULTS["p2p_deadlock"].culprit_ranks == (0, 1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        ZooJob("no_such_fault")
    with pytest.raises(ValueError, match="world_size"):
        ZooJob(world_size=2)


def test_job_id_and_own_workdir_removed(tmp_path) -> None:
    job = ZooJob("late_join")
    assert job.job_id.startswith("zoo-late_join-") and job.workdir.is_dir()
    job.stop()  # never started: nothing to kill, the workdir we made goes away
    assert not job.workdir.exists()
    given = ZooJob("late_join", job_id="j1", workdir=str(tmp_path / "w"))
    given.stop()
    assert given.job_id == "j1" and given.workdir.is_dir()  # the caller's workdir is kept


needs_pyspy = pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")


@pytest.fixture
def torch_available() -> None:
    pytest.importorskip(
        "torch", reason="the hang zoo runs real torch.distributed jobs: torch is not importable"
    )


def _job_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def _assert_all_gone(pids: list[int]) -> None:
    left = [pid for pid in pids if pid_alive(pid)]
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize("fault", list(EXPECTED_STACKS))
@pytest.mark.usefixtures("torch_available")
@pytest.mark.zoo
@needs_pyspy
def test_fault_hangs_where_expected(fault: str, tmp_path) -> None:
    expected = EXPECTED_STACKS[fault]
    with ZooJob(fault, workdir=str(tmp_path), ptracer_pid=os.getpid()) as job:
        job.wait_until_stuck(timeout=90)
        alive = job.alive()
        for rank, want in expected.items():
            assert alive[rank] == (want is not None), f"rank {rank} alive={alive[rank]}\n{job.log(rank)}"
        for rank in alive:
            if alive[rank]:
                env = _job_env(job.pids[rank])
                assert env["HANGDX_JOB_ID"] == job.job_id and env["RANK"] == str(rank)
        dumps = {rank: pyspy_dump(job.pids[rank]) for rank, want in expected.items() if want}
        for rank, dump in dumps.items():
            for needle in expected[rank]:
                assert needle in dump, f"{fault}: rank {rank} stack lacks {needle!r}:\n{dump}"
        # Still at the same line of the program a little later: hung, not slow.
        time.sleep(3)
        for rank, dump in dumps.items():
            assert own_frames(pyspy_dump(job.pids[rank])) == own_frames(dump), f"rank {rank} moved"
        _check_fault_specifics(fault, job, dumps)
        members = group_members(set(job.pids.values()))
        assert set(members) >= {pid for rank, pid in job.pids.items() if alive[rank]}
    _assert_all_gone([*job.pids.values(), *members])


def _check_fault_specifics(fault: str, job: ZooJob, dumps: dict[int, str]) -> None:
    if fault == "rank_killed":
        holder = int((job.workdir / "rank2.holder").read_text())
        assert pid_alive(holder)
        assert _job_env(holder) == {}  # the socket holder must not look like a rank of the job
        assert "host memory at 97%" in job.log(2)
    elif fault == "dataloader_hang":
        workers = [p for p in group_members({job.pids[1]}) if p != job.pids[1]]
        assert len(workers) == 1
        worker = pyspy_dump(workers[0])
        assert "_fetch_remote" in worker and "_worker_loop" in worker
        assert _job_env(workers[0])["RANK"] == "1"  # workers inherit the rank's env
    elif fault == "ddp_unused":
        log = job.log(1)
        assert "Expected to have finished reduction in the prior iteration" in log
        assert "Parameters which did not receive grad for rank 1: aux.bias, aux.weight" in log
        assert "RuntimeError" not in job.log(0)
    elif fault == "op_mismatch":
        # Same call site on every rank: reduce_gradients at the same line.
        lines = {next(x for x in d.splitlines() if "reduce_gradients" in x).strip() for d in dumps.values()}
        assert len(lines) == 1, lines
    elif fault == "lock_deadlock":
        assert "all_reduce" not in dumps[0]


@pytest.mark.usefixtures("torch_available")
@pytest.mark.zoo
@needs_pyspy
def test_straggler_progresses_with_rank2_slow(tmp_path) -> None:
    with ZooJob("straggler", workdir=str(tmp_path)) as job:
        job.wait_until_stuck(timeout=90)
        step_file = job.workdir / "rank0.step"
        before = int(step_file.read_text())
        time.sleep(2)
        after = int(step_file.read_text())
        assert after > before  # still making progress
        assert all(job.alive().values())
        rank2 = [pyspy_dump(job.pids[2]) for _ in range(5)]
        assert any("augment_batch" in d for d in rank2), rank2
        rank0 = [pyspy_dump(job.pids[0]) for _ in range(5)]
        assert any("all_reduce" in d for d in rank0), rank0
        pids = group_members(set(job.pids.values()))
    _assert_all_gone(pids)
