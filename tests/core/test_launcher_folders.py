"""Folders the way launchers write them (issue 16): torchrun --log-dir, Slurm's %j-%t files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.naming import local_rank_from_path, rank_from_name

SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise RuntimeError("bad batch on rank 1")
        dist.barrier()

    main()
    """
)


@pytest.mark.zoo
def test_a_real_torchrun_log_dir_names_the_rank_that_raised(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", port,
         "--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(tmp_path / "train.py")],
        cwd=tmp_path, env=env, capture_output=True, timeout=180,
    )  # fmt: skip
    files = sorted(p.relative_to(tmp_path / "logs").as_posix() for p in (tmp_path / "logs").rglob("*.*"))
    assert any(f.endswith("attempt_0/1/stderr.log") for f in files), files
    v = engine.run(evidence_from_paths([str(tmp_path / "logs")]))
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == [1]


def test_launcher_file_names_give_ranks():
    assert rank_from_name("12345-7.out") == 7  # sbatch --output=%j-%t.out
    assert rank_from_name("slurm-12345.out") is None  # a job's single file names no rank
    assert local_rank_from_path("run_x/attempt_2/3/stderr.log") == 3
    assert local_rank_from_path("run_x/attempt_2/3/notes.txt") is None


def test_torchrun_log_dirs_of_several_nodes_name_the_global_rank_and_its_node(tmp_path):
    """Side by side, each node's tree has local ranks 0 and 1; the global rank is what the file's lines say."""
    watchdog = (
        "[rank{r}]:[E515 18:36:47.341808597 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=241, OpType=ALLREDUCE, NumelIn=6, NumelOut=6, Timeout(ms)=600000) "
        "ran for 600086 milliseconds before timing out.\n"
    )
    oom = "[rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.35 GiB.\n"
    for r in range(4):
        f = tmp_path / f"gpu-node-{r // 2 + 1:02d}" / "run_x" / "attempt_0" / str(r % 2) / "stderr.log"
        f.parent.mkdir(parents=True)
        f.write_text((oom if r == 3 else watchdog).format(r=r))
    v = engine.run(evidence_from_paths([str(tmp_path)]))
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == [3]
    assert v.root_cause.culprit.hosts == ["gpu-node-02"]
