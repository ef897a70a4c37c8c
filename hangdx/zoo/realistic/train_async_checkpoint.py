"""DDP ResNet-style CNN that checkpoints asynchronously from rank 0 so training does not wait for storage.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_async_checkpoint --out-dir runs/async

Every --ckpt-every steps rank 0 copies the state to CPU and hands the write to a one-thread
ThreadPoolExecutor; before the next save it waits for the previous one (never two writes at once).
Field fault: the checkpoint volume stops answering during the first write. The writer thread blocks
in open(); at the next checkpoint rank 0's main thread waits for that write to finish
(Future.result), and the other ranks wait for rank 0 in DDP's all-reduce inside loss.backward().
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from hangdx.zoo.realistic.utils import (
    Heartbeat,
    all_reduce_mean,
    base_parser,
    seed_everything,
    seed_worker,
    setup_distributed,
    setup_logging,
)

log = logging.getLogger("train")


class ResidualBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class TinyResNet(nn.Module):
    def __init__(self, ch: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.layers = nn.Sequential(ResidualBlock(ch), nn.MaxPool2d(2), ResidualBlock(ch))
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(torch.relu(self.stem(x))).mean((2, 3)))


class Stripes(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed + idx)
        label = idx % 10
        x = torch.randn(3, 16, 16, generator=g) * 0.4
        x[:, :, label] += 1.0
        return x, label


class AsyncCheckpointer:
    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = ckpt_dir
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self.pending: Future | None = None

    def save(self, state: dict, step: int) -> None:
        if self.pending is not None:
            self.pending.result()  # never two writes in flight
        cpu_state = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
        self.pending = self.pool.submit(self._write, cpu_state, step)

    def _write(self, state: dict, step: int) -> None:
        t0 = time.perf_counter()
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        with open(self.ckpt_dir / f"step_{step:06d}.pt", "wb") as f:  # a file object: works for fsspec too
            torch.save(state, f)
        log.info("checkpoint step %d written in %.2fs", step, time.perf_counter() - t0)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt-every", type=int, default=3)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    data = Stripes(4096, seed=args.seed)
    sampler = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
    )
    model = DDP(TinyResNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    ckpt = AsyncCheckpointer(out_dir / "checkpoints") if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            heartbeat.beat(step)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % args.log_every == 0:
                mean = all_reduce_mean(loss.item())
                if rank == 0:
                    log.info("epoch %d step %d loss %.4f", epoch, step, mean)
            if ckpt is not None and step % args.ckpt_every == 0:
                ckpt.save({**model.module.state_dict(), "step": step}, step)
    if ckpt is not None and ckpt.pending is not None:
        ckpt.pending.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
