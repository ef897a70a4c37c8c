"""Starts a hang-zoo job (hangdx.zoo.job, one process per rank, gloo on 127.0.0.1) and cleans it up.

No torchrun on purpose: its agent kills every rank as soon as one dies, which would end the
rank_killed hang before anyone could look at it.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    category: str
    culprit_ranks: tuple[int, ...]
    hangs: bool
    # A realistic program (hangdx.zoo.realistic.<program>) instead of a hangdx.zoo.job scenario.
    program: str = ""


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "skip_collective",
            "rank 1 gets a NaN loss, skips the metrics all_reduce and waits in the next step's broadcast",
            "conditional_collective",
            (1,),
            True,
        ),
        Fault(
            "uneven_data",
            "rank 3's data shard is shorter: it waits at the end-of-epoch barrier while the others all_reduce",
            "conditional_collective",
            (3,),
            True,
        ),
        Fault(
            "op_mismatch",
            "at the same line, rank 2 broadcasts the gradients (stale config) while the others all_reduce them",
            "collective_mismatch",
            (2,),
            True,
        ),
        Fault(
            "rank_killed",
            "rank 2 is SIGKILLed mid-training (like the OOM killer); the others wait in all_reduce",
            "rank_crashed",
            (2,),
            True,
        ),
        Fault(
            "dataloader_hang",
            "rank 1's DataLoader worker blocks fetching a sample; rank 1 waits in DataLoader.__next__",
            "dataloader_stall",
            (1,),
            True,
        ),
        Fault(
            "io_hang",
            "rank 3 blocks opening its checkpoint shard in load_checkpoint; the others wait at a barrier",
            "io_stall",
            (3,),
            True,
        ),
        Fault(
            "lock_deadlock",
            "rank 0's main thread and its metrics-flusher thread take two locks in opposite order",
            "user_deadlock",
            (0,),
            True,
        ),
        Fault(
            "p2p_deadlock",
            "ranks 0 and 1 both recv from each other before sending; ranks 2 and 3 wait in the next all_reduce",
            "p2p_deadlock",
            (0, 1),
            True,
        ),
        Fault(
            "ddp_unused",
            "DDP without find_unused_parameters: rank 1 skips the aux head, raises 'Expected to have finished "
            "reduction' and waits in its shutdown barrier; the others wait in backward",
            "ddp_unused_parameters",
            (1,),
            True,
        ),
        Fault(
            "late_join",
            "rank 3 never reaches init_process_group (waits for a dataset download); ranks 0-2 wait in rendezvous",
            "comm_init_failure",
            (3,),
            True,
        ),
        Fault(
            "straggler",
            "the job keeps stepping, but rank 2 spends ~0.3 s of extra CPU per step",
            "straggler",
            (2,),
            False,
        ),
    )
}
DEFAULT_FAULT = "skip_collective"

# The held-out set: training programs written as users write them (hangdx/zoo/realistic/).
REALISTIC: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "real_dataloader_nfs",
            "DDP CNN: a sample file of rank 1's shard is on an NFS server that stopped answering; its "
            "DataLoader worker blocks in open(), the other ranks wait in loss.backward()",
            "dataloader_stall",
            (1,),
            True,
            "train_dataloader_nfs",
        ),
        Fault(
            "real_eval_worker_died",
            "DDP transformer LM: rank 0 hands evaluation to a spawned process that dies (ZeroDivisionError) "
            "and waits on its result queue; the others wait in DDP's buffer broadcast in the next forward",
            "user_deadlock",
            (0,),
            True,
            "train_eval_worker",
        ),
        Fault(
            "real_checkpoint_hung_mount",
            "DDP CNN: every rank saves its resume state; rank 2's checkpoint path is on a hung mount and "
            "torch.save blocks in open(), the others wait in the next loss.backward()",
            "io_stall",
            (2,),
            True,
            "train_checkpoint_mount",
        ),
        Fault(
            "real_early_stopping",
            "DDP regression: validation loss is not all-reduced, rank 3's early stopping fires alone and it "
            "waits in the final barrier while the others train on in loss.backward()",
            "conditional_collective",
            (3,),
            True,
            "train_early_stopping",
        ),
        Fault(
            "real_pipeline_1f1b",
            "4-stage pipeline, hand-written 1F1B on blocking send/recv: stage 2 sends its next activation "
            "while stage 3 sends back its first gradient, each waiting for the other; stages 0-1 wait behind",
            "p2p_deadlock",
            (2, 3),
            True,
            "train_pipeline",
        ),
        Fault(
            "real_multitask_unused",
            "DDP multi-task model (find_unused_parameters=False): rank 1's batches carry no auxiliary "
            "labels, its aux head gets no gradient, and DDP's reduction never completes",
            "ddp_unused_parameters",
            (1,),
            True,
            "train_multitask",
        ),
        Fault(
            "real_long_sequence_oom",
            "DDP language model without truncation: rank 2 meets a very long document and is OOM-killed "
            "(cgroup limit); the others wait in loss.backward()",
            "rank_crashed",
            (2,),
            True,
            "train_long_sequence",
        ),
        Fault(
            "real_slow_augmentation",
            "DDP CNN: rank 1's camera records 512x512 frames that its DataLoader worker blurs and resizes on "
            "the fly; the job advances, every step held back by rank 1",
            "straggler",
            (1,),
            False,
            "train_slow_augmentation",
        ),
        Fault(
            "real_fsdp_dcp_hung_mount",
            "FSDP (fully_shard) classifier saving sharded checkpoints with dcp.save: rank 2's shard file is "
            "on a server that stopped answering; the others wait in dcp.save's closing collective",
            "io_stall",
            (2,),
            True,
            "train_fsdp_checkpoint",
        ),
        Fault(
            "real_async_checkpoint",
            "DDP ResNet: rank 0 writes checkpoints in a background thread; the volume hangs in the first write, "
            "rank 0's next save waits for it (Future.result), the others wait in loss.backward()",
            "io_stall",
            (0,),
            True,
            "train_async_checkpoint",
        ),
        Fault(
            "real_prefetch_thread_died",
            "DDP text classifier: rank 1's background prefetch thread dies on a corrupt record (KeyError) and "
            "its training loop waits on the empty prefetch queue; the others wait in loss.backward()",
            "dataloader_stall",
            (1,),
            True,
            "train_background_prefetch",
        ),
        Fault(
            "real_uneven_streaming_shards",
            "DDP on a streaming IterableDataset: rank 2's shards are short, it runs out of batches and waits "
            "in the end-of-epoch barrier while the others are still in loss.backward()",
            "conditional_collective",
            (2,),
            True,
            "train_streaming_shards",
        ),
        Fault(
            "real_callback_relock",
            "DDP autoencoder: rank 0's best-checkpoint callback asks the metric tracker for the best value while "
            "the tracker holds its (non-reentrant) lock; rank 0 deadlocks on itself, the others wait in loss.backward()",
            "user_deadlock",
            (0,),
            True,
            "train_metric_callbacks",
        ),
    )
}
ALL_FAULTS: dict[str, Fault] = {**FAULTS, **REALISTIC}
# A realistic job counts as hung when no rank's heartbeat has changed for this long.
REALISTIC_QUIET_SECONDS = 5.0

# The rank that kills itself in rank_killed: its marker comes before its death.
_KILLED_RANK = {"rank_killed": 2, "real_long_sequence_oom": 2}
# Debug settings inherited from the caller's shell that would change what the zoo shows: DETAIL
# wraps every collective in a fingerprint check that turns the mismatch hangs into immediate
# errors (and segfaults DDP construction in torch 2.13 CPU).
_SCRUBBED_ENV = ("TORCH_DISTRIBUTED_DEBUG",)
# In ddp_unused, INFO makes DDP's error name the unused parameters (aux.weight, aux.bias).
_FAULT_ENV = {
    "ddp_unused": {"TORCH_DISTRIBUTED_DEBUG": "INFO"},
    # The simulated cgroup OOM killer of hangdx.zoo.realistic.utils watches this rank.
    "real_long_sequence_oom": {"HANGDX_ZOO_OOM_RANK": "2", "HANGDX_ZOO_OOM_GROWTH_MB": "150"},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True when the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def group_members(pgids: set[int] | frozenset[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of `pgids`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _pgid_of(int(entry)) in pgids and pid_alive(int(entry)):
            members.append(int(entry))
    return members


def _pgid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def steps_done(workdir: Path, rank: int) -> int:
    """How many steps a straggler-type rank reports having finished."""
    try:
        return int((workdir / f"rank{rank}.step").read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def reached_fault(workdir: Path, fault: Fault, world_size: int, rank_alive: Callable[[int], bool]) -> bool:
    """Has every rank reached the place the fault leaves it (or, for a job that crawls, done 3 steps)?"""
    ranks = range(world_size)
    if not fault.hangs:
        return all(steps_done(workdir, r) >= 3 for r in ranks)
    if not all((workdir / f"rank{r}.stuck").exists() for r in ranks):
        return False
    killed = _KILLED_RANK.get(fault.name)
    return killed is None or not rank_alive(killed)


def went_quiet(workdir: Path, world_size: int, quiet: float = REALISTIC_QUIET_SECONDS) -> bool:
    """Has every rank written a heartbeat, and none changed for `quiet` seconds (a realistic job's hang)?"""
    newest = 0.0
    for rank in range(world_size):
        try:
            newest = max(newest, (workdir / f"rank{rank}.step").stat().st_mtime)
        except OSError:
            return False
    return time.time() - newest >= quiet


class ZooJob:
    """A running zoo job: one process (and session) per rank; `with ZooJob(...) as job:` starts and stops it."""

    def __init__(
        self,
        fault: str = DEFAULT_FAULT,
        world_size: int = 4,
        job_id: str | None = None,
        workdir: str | None = None,
        ptracer_pid: int | None = None,
        control_plane: bool = False,
    ) -> None:
        if fault not in ALL_FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(ALL_FAULTS)}")
        if world_size < 4:
            raise ValueError(f"the zoo's faults need world_size >= 4, got {world_size}")
        self.fault = ALL_FAULTS[fault]
        self.world_size = world_size
        self.job_id = job_id or f"zoo-{fault}-{secrets.token_hex(4)}"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hangdx-zoo-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ptracer_pid = ptracer_pid
        self.control_plane = control_plane  # ranks serve their Flight Recorder on a unix socket
        self.pids: dict[int, int] = {}
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._started = False
        self._stopped = False

    def __enter__(self) -> ZooJob:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _env(self, rank: int, port: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        env.update(_FAULT_ENV.get(self.fault.name, {}))
        env.update(
            HANGDX_JOB_ID=self.job_id,
            HANGDX_ZOO_WORKDIR=str(self.workdir),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        if self.ptracer_pid is not None:
            # A negative pid: any tracer of our user (a job left running for later diagnoses).
            env["HANGDX_PTRACER"] = "any" if self.ptracer_pid < 0 else str(self.ptracer_pid)
        if self.control_plane and not self.fault.program:  # realistic programs serve no control plane
            env["TORCH_WORKER_SERVER_SOCKET"] = str(self.workdir / f"rank{rank}.sock")
        return env

    def start(self) -> None:
        """Spawn every rank; a second call does nothing."""
        if self._started:
            return
        self._started = True
        for pattern in ("rank*.stuck", "rank*.step", "rank*.holder", "rank*.log"):
            for old in self.workdir.glob(pattern):
                old.unlink()
        atexit.register(self.stop)
        port = free_port()
        if self.fault.program:
            from hangdx.zoo.realistic import prepare

            prepare(self.fault.name, self.workdir, self.world_size)
            cmd = [
                sys.executable,
                "-m",
                f"hangdx.zoo.realistic.{self.fault.program}",
                "--out-dir",
                str(self.workdir),
            ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "hangdx.zoo.job",
                "--fault",
                self.fault.name,
                "--workdir",
                str(self.workdir),
            ]
        for rank in range(self.world_size):
            with open(self._log_path(rank), "wb") as log:
                proc = subprocess.Popen(
                    cmd,
                    env=self._env(rank, port),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: stop() kills rank + workers + fd holder
                )
            self._procs[rank] = proc
            self.pids[rank] = proc.pid

    def _log_path(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.log"

    def log(self, rank: int) -> str:
        try:
            return self._log_path(rank).read_text(errors="replace")
        except OSError:
            return ""

    def _tails(self, lines: int = 15) -> str:
        parts = []
        for rank in range(self.world_size):
            tail = "\n".join(self.log(rank).splitlines()[-lines:])
            parts.append(f"--- rank {rank} (pid {self.pids.get(rank)}) ---\n{tail}")
        return "\n".join(parts)

    def _ready(self) -> bool:
        if self.fault.program and self.fault.hangs:
            killed = _KILLED_RANK.get(self.fault.name)
            if killed is not None and self._procs[killed].poll() is None:
                return False
            return went_quiet(self.workdir, self.world_size)
        return reached_fault(
            self.workdir, self.fault, self.world_size, lambda r: self._procs[r].poll() is None
        )

    def wait_until_stuck(self, timeout: float = 90) -> None:
        """Block until every rank sits where the fault leaves it (or, for straggler, has done 3 steps)."""
        if not self._started:
            raise RuntimeError("wait_until_stuck() before start()")
        deadline = time.monotonic() + timeout
        expected_dead = _KILLED_RANK.get(self.fault.name)
        while not self._ready():
            for rank, proc in self._procs.items():
                if rank != expected_dead and proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.job_id}: rank {rank} exited with status {proc.returncode} before the job "
                        f"got stuck\n{self._tails()}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.job_id}: not stuck after {timeout:.0f} s\n{self._tails()}")
            time.sleep(0.2)
        if not self.fault.program:
            time.sleep(1.0)  # the marker comes just before the blocking call: let every rank get into it
        for proc in self._procs.values():
            proc.poll()  # reap the killed rank so its pid is really gone

    def alive(self) -> dict[int, bool]:
        """rank -> whether its process is still running (zombies count as gone)."""
        for proc in self._procs.values():
            proc.poll()
        return {rank: pid_alive(pid) for rank, pid in self.pids.items()}

    def _holder_pids(self) -> list[int]:
        pids = []
        for path in self.workdir.glob("rank*.holder"):
            try:
                pids.append(int(path.read_text().strip()))
            except (OSError, ValueError):
                continue
        return pids

    def detach(self) -> str:
        """Leave the job running after this process ends (`hangdx demo --keep`); the shell command that stops it
        (every rank's process group, then its workdir)."""
        atexit.unregister(self.stop)
        self._stopped = True
        groups = " ".join(f"-{pid}" for pid in sorted(self.pids.values()))
        return f"kill -KILL -- {groups}; rm -rf {shlex.quote(str(self.workdir))}"

    def stop(self) -> None:
        """SIGKILL every rank's process group (rank, DataLoader workers, fd holder), reap, clean up."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        our_groups = set(self.pids.values())  # start_new_session made each rank's pid its pgid
        for pid in self._holder_pids():
            # The holder outlives its rank; kill it only while it is still in one of our groups.
            if _pgid_of(pid) in our_groups:
                _signal(os.kill, pid)
        for proc in self._procs.values():
            # Until we reap it, the rank's pid (= its pgid) cannot be reused, so this group is ours.
            if proc.returncode is None:
                _signal(os.killpg, proc.pid)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # Workers and the holder are not our children: wait until the kernel has finished them off.
        deadline = time.monotonic() + 5
        while group_members(our_groups) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _signal(kill: Callable[[int, int], None], target: int) -> None:
    try:
        kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
