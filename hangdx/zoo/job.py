"""One rank of a small gloo/CPU training job that hangs (or crawls) with a known fault.

Run by hangdx.zoo.launch, one process per rank: `python -m hangdx.zoo.job --fault NAME --workdir DIR`,
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment. Every fault is a few
steps of a realistic-looking loop (train_step, sync_gradients, log_metrics, ...) so that py-spy stacks
look like a real job's. Just before a rank reaches the call where it will block for good it writes
`<workdir>/rank<r>.stuck`; in the straggler job every rank writes its step count to `rank<r>.step`.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

PR_SET_PTRACER = 0x59616D61  # Yama: let this pid (and its descendants) ptrace us
PR_SET_PTRACER_ANY = 0xFFFFFFFFFFFFFFFF  # ... or any process (of our own user: ptrace still checks that)
STRAGGLER_MAX_SECONDS = 600.0


def allow_ptrace(*_args: object) -> None:
    """Let the process named by HANGDX_PTRACER attach py-spy to us under Yama ptrace_scope=1 (`any`: a job left
    hung by `hangdx demo --keep`, diagnosed later by another process of the same user)."""
    pid = os.environ.get("HANGDX_PTRACER", "")
    if not (pid.isdigit() or pid == "any") or not sys.platform.startswith("linux"):
        return
    tracer = PR_SET_PTRACER_ANY if pid == "any" else int(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(tracer), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl or no Yama: nothing to allow


class Rank:
    """Who this process is and where it leaves its markers."""

    def __init__(self, workdir: Path) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.workdir = workdir

    def log(self, msg: str) -> None:
        print(f"[rank{self.rank}] {msg}", flush=True)

    def mark_stuck(self, where: str) -> None:
        """Tell the launcher this rank is about to enter the call it will never leave (silently: the log stays realistic)."""
        _write(self.workdir / f"rank{self.rank}.stuck", f"{where}\n")

    def mark_step(self, step: int) -> None:
        _write(self.workdir / f"rank{self.rank}.step", f"{step}\n")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic, so the launcher never reads half a number


# --- the "model" and the steps every fault shares -------------------------------------------------


class TinyNet(nn.Module):
    """A three-layer MLP with an optional auxiliary branch (for the DDP fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.aux = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.head(h)


def init_distributed() -> None:
    # An hour, so no hang turns into a timeout error while it is being looked at.
    dist.init_process_group("gloo", timeout=timedelta(hours=1))


def make_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    model.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def sync_gradients(model: nn.Module, world: int) -> None:
    grads = flat_grads(model)
    dist.all_reduce(grads)
    grads /= world


def apply_update(model: nn.Module, lr: float = 0.01) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def log_metrics(me: Rank, step: int, loss: torch.Tensor) -> float:
    stats = torch.stack([loss, torch.tensor(1.0)])
    dist.all_reduce(stats)
    mean = (stats[0] / stats[1]).item()
    if me.rank == 0:
        me.log(f"step {step} loss {mean:.4f}")
    return mean


def setup(me: Rank) -> nn.Module:
    init_distributed()
    torch.manual_seed(0)  # same initial weights everywhere, as DDP would broadcast
    return TinyNet()


# --- faults -----------------------------------------------------------------------------------------


def run_skip_collective(me: Rank) -> None:
    """Rank 1 sees a NaN loss, skips the metrics all_reduce and goes on to the next step."""
    model = setup(me)
    nan_step = 3
    for step in range(100):
        if should_stop(me, step):
            break
        loss = train_step(model, make_batch(step, me.rank))
        if me.rank == 1 and step == nan_step:
            loss = torch.tensor(float("nan"))  # a bad batch on this rank only
        sync_gradients(model, me.world)
        apply_update(model)
        if not math.isfinite(loss.item()):
            me.log(f"step {step}: loss is NaN, skipping metrics")
            continue
        if step == nan_step:
            me.mark_stuck("log_metrics all_reduce")
        log_metrics(me, step, loss)


def should_stop(me: Rank, step: int) -> bool:
    """Rank 0 decides whether the time budget is spent and tells everyone."""
    flag = torch.tensor([0.0])
    if step == 4 and me.rank == 1:
        me.mark_stuck("should_stop broadcast")
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def run_uneven_data(me: Rank) -> None:
    """Rank 3's data shard is shorter: it leaves the loop and waits at the end-of-epoch barrier."""
    model = setup(me)
    shard = [make_batch(i, me.rank) for i in range(4 if me.rank == 3 else 6)]
    for step, batch in enumerate(shard):
        train_step(model, batch)
        if step == 4:
            me.mark_stuck("sync_gradients all_reduce")
        sync_gradients(model, me.world)
        apply_update(model)
    finish_epoch(me)


def finish_epoch(me: Rank) -> None:
    me.mark_stuck("finish_epoch barrier")
    dist.barrier()
    me.log("epoch done")


def load_sync_config(me: Rank) -> dict[str, str]:
    """Each rank reads its own copy of the config; rank 2's copy is stale."""
    return {"grad_sync": "broadcast" if me.rank == 2 else "all_reduce", "warmup_sync": "all_reduce"}


def reduce_gradients(grads: torch.Tensor, mode: str) -> None:
    reduce_op = dist.all_reduce if mode == "all_reduce" else functools.partial(dist.broadcast, src=0)
    reduce_op(grads)  # the one call site every rank goes through


def run_op_mismatch(me: Rank) -> None:
    """After warm-up rank 2 broadcasts where everyone else all_reduces, at the same line."""
    model = setup(me)
    cfg = load_sync_config(me)
    for step in range(10):
        train_step(model, make_batch(step, me.rank))
        mode = cfg["warmup_sync"] if step < 3 else cfg["grad_sync"]
        if step == 3:
            me.mark_stuck(f"reduce_gradients {mode}")
        reduce_gradients(flat_grads(model), mode)
        apply_update(model)


def socket_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except OSError:
            continue
    return fds


def die_like_oom_kill(me: Rank) -> None:
    """SIGKILL ourselves, leaving our sockets open in a holder so peers hang as they would under NCCL."""
    # Without the holder the kernel closes the sockets and gloo peers fail fast with
    # "Connection closed by peer"; a NCCL job's peers would keep waiting instead.
    holder = subprocess.Popen(
        ["sleep", "infinity"],
        pass_fds=socket_fds(),
        env={},  # no HANGDX_JOB_ID/RANK: the holder is not a rank of the job
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _write(me.workdir / f"rank{me.rank}.holder", f"{holder.pid}\n")
    me.mark_stuck("SIGKILL")
    os.kill(os.getpid(), signal.SIGKILL)


def run_rank_killed(me: Rank) -> None:
    """Rank 2 is killed (think OOM killer) mid-training; the others wait for its gradients."""
    model = setup(me)
    for step in range(10):
        if me.rank == 2 and step == 3:
            me.log(f"step {step}: host memory at 97%, loading next batch")
            die_like_oom_kill(me)
        train_step(model, make_batch(step, me.rank))
        if step == 3:
            me.mark_stuck("sync_gradients all_reduce")
        sync_gradients(model, me.world)
        apply_update(model)


class RemoteSampleDataset(Dataset):
    """Samples fetched from a remote sample store; rank 1's store stops answering at one index."""

    def __init__(self, rank: int, length: int, stall_index: int | None) -> None:
        self.rank = rank
        self.length = length
        self.stall_index = stall_index
        # Our end of the connection to the store; the store never replies.
        self._conn, self._store_end = socket.socketpair()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if idx == self.stall_index:
            self._fetch_remote(idx)
        return make_batch(idx, self.rank)

    def _fetch_remote(self, idx: int) -> bytes:
        self._conn.sendall(f"GET sample/{idx}\n".encode())
        return self._conn.recv(1 << 16)  # blocks: the reply never comes


def run_dataloader_hang(me: Rank) -> None:
    """Rank 1's DataLoader worker blocks fetching a sample; rank 1 waits in DataLoader.__next__."""
    model = setup(me)
    stall_at = 4
    data = RemoteSampleDataset(me.rank, 10, stall_at if me.rank == 1 else None)
    loader = DataLoader(data, batch_size=None, num_workers=1, worker_init_fn=allow_ptrace)
    it = iter(loader)
    for step in range(10):
        if step == stall_at:
            me.mark_stuck("DataLoader __next__" if me.rank == 1 else "sync_gradients all_reduce")
        batch = next(it)
        train_step(model, batch)
        sync_gradients(model, me.world)
        apply_update(model)


def stage_checkpoint(me: Rank, model: nn.Module) -> Path:
    """Put this rank's checkpoint shard in place; rank 3's sits on a mount that never answers."""
    ckpt_dir = me.workdir / "ckpt"
    ckpt_dir.mkdir(exist_ok=True)
    path = ckpt_dir / f"shard-{me.rank:05d}.pt"
    if me.rank == 3:
        if not (path.exists() and stat.S_ISFIFO(path.stat().st_mode)):
            os.mkfifo(path)  # open() for reading blocks until a writer shows up: none will
    else:
        torch.save(model.state_dict(), path)
    return path


def load_checkpoint(me: Rank, model: nn.Module, path: Path) -> None:
    if me.rank == 3:
        me.mark_stuck("load_checkpoint open")
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state)
    me.log(f"loaded {path.name}")


def run_io_hang(me: Rank) -> None:
    """Rank 3 blocks opening its checkpoint shard; the others wait at the barrier after loading."""
    model = setup(me)
    path = stage_checkpoint(me, model)
    load_checkpoint(me, model, path)
    me.mark_stuck("barrier after load_checkpoint")
    dist.barrier()
    for step in range(3):
        train_step(model, make_batch(step, me.rank))
        sync_gradients(model, me.world)


class MetricsWriter:
    """Rank 0's metrics buffer with a background flusher thread (which takes the locks in the wrong order)."""

    def __init__(self, me: Rank) -> None:
        self.me = me
        self.path = me.workdir / "metrics.jsonl"
        self._buffer_lock = threading.Lock()
        self._file_lock = threading.Lock()
        self._pending: list[str] = []
        self._flush_requested = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name="metrics-flusher", daemon=True)
        self._thread.start()

    def write(self, step: int, loss: float) -> None:
        with self._buffer_lock:
            self._pending.append(f'{{"step": {step}, "loss": {loss:.5f}}}\n')
            if len(self._pending) >= 4:
                self._flush_requested.set()
                self._rotate_if_large()

    def _rotate_if_large(self) -> None:
        summary = torch.randn(64, 64)
        deadline = time.monotonic() + 0.3  # summarizing the buffer takes a while
        while time.monotonic() < deadline:
            summary = torch.tanh(summary @ summary.T / 64)
        self.me.mark_stuck("MetricsWriter._rotate_if_large file lock")
        with self._file_lock:  # the flusher holds this and waits for _buffer_lock, which we hold
            self.path.touch()

    def _flush_loop(self) -> None:
        while True:
            self._flush_requested.wait()
            self._flush_requested.clear()
            with self._file_lock:
                with self._buffer_lock:
                    lines, self._pending = self._pending, []
                with self.path.open("a") as f:
                    f.writelines(lines)


def run_lock_deadlock(me: Rank) -> None:
    """Rank 0 deadlocks between its main thread and its metrics flusher; the others wait for it."""
    model = setup(me)
    writer = MetricsWriter(me) if me.rank == 0 else None
    for step in range(10):
        loss = train_step(model, make_batch(step, me.rank))
        if step == 4 and me.rank != 0:
            me.mark_stuck("sync_gradients all_reduce")
        sync_gradients(model, me.world)
        apply_update(model)
        mean = log_metrics(me, step, loss)
        if writer is not None:
            writer.write(step, mean)


def exchange_boundary(me: Rank, buf: torch.Tensor, peer: int, send_first: bool) -> torch.Tensor:
    """Swap boundary activations with the neighbouring stage."""
    incoming = torch.empty_like(buf)
    if send_first:
        dist.send(buf, dst=peer)
        dist.recv(incoming, src=peer)
    else:
        dist.recv(incoming, src=peer)
        dist.send(buf, dst=peer)
    return incoming


def run_p2p_deadlock(me: Rank) -> None:
    """Ranks 0 and 1 both recv before they send; ranks 2 and 3 swap fine and wait in the next all_reduce."""
    model = setup(me)
    for step in range(10):
        train_step(model, make_batch(step, me.rank))
        if step == 3:
            me.mark_stuck("sync_gradients all_reduce")
        sync_gradients(model, me.world)
        apply_update(model)
        if step == 2 and me.rank < 4:
            peer = me.rank ^ 1
            # The bug: "the lower rank sends first" was written as `rank >= 2 and rank % 2 == 0`.
            send_first = me.rank >= 2 and me.rank % 2 == 0
            if me.rank < 2:
                me.mark_stuck(f"exchange_boundary recv from rank {peer}")
            exchange_boundary(me, flat_grads(model)[:64].clone(), peer, send_first)


def run_ddp_unused(me: Rank) -> None:
    """On rank 1 the aux head goes unused; DDP (find_unused_parameters=False) never reduces its bucket."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_distributed()
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(10):
            x, y = make_batch(step, me.rank)
            # Rank 1's batches carry no auxiliary targets from step 2 on, so it skips the aux branch.
            use_aux = not (me.rank == 1 and step >= 2)
            loss = nn.functional.mse_loss(model(x, use_aux=use_aux), y)
            if step == 2 and me.rank != 1:
                me.mark_stuck("loss.backward (DDP gradient all_reduce)")
            loss.backward()
            opt.step()
            opt.zero_grad()
    except Exception:
        traceback.print_exc()
        shutdown(me)


def shutdown(me: Rank) -> None:
    """Wait for everyone before tearing the process group down."""
    me.mark_stuck("shutdown barrier")
    dist.barrier()
    dist.destroy_process_group()


def wait_for_dataset_download(me: Rank, path: Path) -> None:
    """Wait until the rank-local dataset download finishes; on rank 3 it never does."""
    me.mark_stuck("wait_for_dataset_download")
    while not path.exists():
        time.sleep(0.5)


def run_late_join(me: Rank) -> None:
    """Rank 3 never reaches init_process_group; ranks 0-2 wait for it in rendezvous."""
    if me.rank == 3:
        wait_for_dataset_download(me, me.workdir / "dataset" / "DONE")
    else:
        me.mark_stuck("init_process_group")
    model = setup(me)
    for step in range(3):
        train_step(model, make_batch(step, me.rank))
        sync_gradients(model, me.world)


def augment_batch(
    batch: tuple[torch.Tensor, torch.Tensor], seconds: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expensive on-the-fly augmentation, done only on rank 2 (its data pipeline is misconfigured)."""
    x, y = batch
    kernel = torch.randn(128, 128) / 128
    work = torch.randn(128, 128)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        work = torch.tanh(work @ kernel)
    return x + 1e-6 * work[:8, :16], y


def run_straggler(me: Rank) -> None:
    """Every step all_reduces, but rank 2 spends ~0.3 s extra per step; runs until killed (max 10 min)."""
    model = setup(me)
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < STRAGGLER_MAX_SECONDS:
        batch = make_batch(step, me.rank)
        if me.rank == 2:
            batch = augment_batch(batch, 0.3)
        loss = train_step(model, batch)
        sync_gradients(model, me.world)
        apply_update(model)
        log_metrics(me, step, loss)
        step += 1
        me.mark_step(step)
    dist.destroy_process_group()


FAULTS = {
    "skip_collective": run_skip_collective,
    "uneven_data": run_uneven_data,
    "op_mismatch": run_op_mismatch,
    "rank_killed": run_rank_killed,
    "dataloader_hang": run_dataloader_hang,
    "io_hang": run_io_hang,
    "lock_deadlock": run_lock_deadlock,
    "p2p_deadlock": run_p2p_deadlock,
    "ddp_unused": run_ddp_unused,
    "late_join": run_late_join,
    "straggler": run_straggler,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hangdx.zoo.job", description=__doc__.splitlines()[0])
    parser.add_argument("--fault", default="skip_collective", choices=sorted(FAULTS))
    parser.add_argument("--workdir", default=".", help="where the marker files go")
    args = parser.parse_args(argv)
    allow_ptrace()
    torch.set_num_threads(1)
    me = Rank(Path(args.workdir))
    me.log(f"pid {os.getpid()} fault {args.fault} world {me.world}")
    if os.environ.get("TORCH_WORKER_SERVER_SOCKET"):
        # torch's control plane: serves this rank's Flight Recorder (and more) on a unix socket.
        from torch.distributed.elastic.control_plane import worker_main

        with worker_main():
            FAULTS[args.fault](me)
    else:
        FAULTS[args.fault](me)
    me.log("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
