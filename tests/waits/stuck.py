"""Tiny real jobs that block in one kind of wait, for recording py-spy fixtures (see record.py).

`python tests/waits/stuck.py MODE DIR` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set: every rank trains a
small DDP model on gloo (CPU); at step 3 rank ODD (default 1) stops in the wait MODE names, so the other ranks
block in loss.backward() (DDP's gradient all-reduce, run from autograd hooks). Before blocking, each rank writes
DIR/rank<r>.stuck so the recorder knows when to dump. Modes: queue, dataloader, storage, child, barrier, p2p_cycle,
pipeline (4 stages; stage 0 on a dead loader's queue),
eval_process (a side process that died before answering), fsdp_queue (the queue job under FSDP2),
poll (a time.sleep loop waiting for a file nobody writes), compute (an endless step), lock (a lock a dead thread held).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

ODD = int(os.environ.get("ODD_RANK", "1"))


class Blocks(Dataset):
    """A dataset whose item 20 never arrives (its reader blocks for good), as a stuck network file system would."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= 20:
            threading.Event().wait()
        return torch.randn(8)


def producer(q: queue.Queue) -> None:
    """Feeds two batches, then dies of an exception: its consumer waits forever."""
    q.put(torch.randn(4, 8))
    q.put(torch.randn(4, 8))
    raise RuntimeError("producer died")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    loss = model(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def next_batch(mode: str, rank: int, step: int, q: queue.Queue, it, fifo: Path, mark) -> torch.Tensor:
    if rank != ODD or step < 3:
        return torch.randn(4, 8)
    mark()
    if mode == "queue":
        return q.get()
    if mode == "dataloader":
        return next(it)
    if mode == "storage":
        return torch.load(fifo)  # a FIFO nobody writes: open() blocks, as a read from a dead NFS server
    if mode == "child":
        subprocess.run(["sleep", "3600"], check=True)
    if mode == "eval_process":
        results = multiprocessing.get_context("fork").Queue()
        evaluator = multiprocessing.get_context("fork").Process(target=os._exit, args=(1,))  # dies at once
        evaluator.start()
        return results.get()  # the evaluation result that never comes
    if mode == "compute":
        x = torch.randn(64, 64)
        while True:
            x = torch.tanh(x @ x)  # a step that never ends (an endless loop in the program's own code)
    if mode == "lock":
        lock = threading.Lock()
        holder = threading.Thread(target=lock.acquire)  # takes the lock and exits without releasing it
        holder.start()
        holder.join()
        with lock:
            pass
    if mode == "poll":
        flag = fifo.with_name("ready.flag")
        while not flag.exists():  # waits for a file nobody writes (another job's output, a marker)
            time.sleep(0.5)
    if mode == "barrier":
        dist.barrier()  # a rank-conditional barrier (an evaluation only this rank runs)
    return torch.randn(4, 8)


def p2p_cycle(rank: int, mark) -> None:
    """Ranks 0 and 1 both receive first (a cycle); 2 waits on 1 and 3 on 2 (backed up behind it)."""
    t = torch.zeros(4)
    src = {0: 1, 1: 0, 2: 1, 3: 2}[rank]
    mark()
    dist.recv(t, src=src)
    dist.send(t, dst=(rank + 1) % dist.get_world_size())


def pipeline(rank: int, q: queue.Queue, mark) -> None:
    """Pipeline stages: stage 0 waits for its input batch from a loader thread that died; each later stage
    receives its activations from the stage before it (backed up behind stage 0)."""
    t = torch.zeros(4)
    mark()
    if rank == 0:
        t = q.get()
    else:
        dist.recv(t, src=rank - 1)
    if rank + 1 < dist.get_world_size():
        dist.send(t, dst=rank + 1)


def main() -> None:
    mode, workdir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(hours=1))

    def mark() -> None:
        (workdir / f"rank{rank}.stuck").write_text(mode)

    if mode == "p2p_cycle":
        p2p_cycle(rank, mark)
        return
    if mode == "pipeline":
        q: queue.Queue = queue.Queue()
        threading.Thread(target=producer, args=(q,), daemon=True).start()
        time.sleep(0.2)
        q.get(), q.get()  # the loader thread's two batches; it is dead now
        pipeline(rank, q, mark)
        return
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    if mode.startswith("fsdp"):  # FSDP2: all-gather in forward, reduce-scatter in backward hooks
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2]):
            fully_shard(layer)
        model = fully_shard(net)
        mode = mode.removeprefix("fsdp_")
    else:
        model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=producer, args=(q,), daemon=True).start()
    time.sleep(0.2)
    q.get(), q.get()  # the producer's two batches; it is dead now
    it = None
    if rank == ODD and mode == "dataloader":
        it = iter(DataLoader(Blocks(), batch_size=4, num_workers=1, shuffle=False))
    if it is not None:
        for _ in range(4):
            next(it)  # items 0-15; the next batch needs item 20
    fifo = workdir / "ckpt.pt"
    for step in range(100):
        batch = next_batch(mode, rank, step, q, it, fifo, mark)
        if step == 3 and rank != ODD:
            mark()
        train_step(model, opt, batch)


if __name__ == "__main__":
    main()
