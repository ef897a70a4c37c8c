"""DDP autoencoder on sensor windows with a small metrics tracker and callbacks (best-checkpoint saver).

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_metric_callbacks --out-dir runs/ae

The tracker guards its history with a lock (a background exporter thread reads it) and calls the
registered callbacks after each update. Rank 0 registers a callback that keeps the best checkpoint by
validation loss. Field fault: the callback asks the tracker for the best value so far, and the
tracker calls callbacks while still holding its lock, a plain threading.Lock: at the first
validation rank 0's main thread waits for a lock it holds itself. The other ranks wait for rank 0 in
DDP's all-reduce inside loss.backward().
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
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


class SensorWindows(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        t = torch.linspace(0, 20, 64)
        phase = torch.rand(n, 1, generator=g) * 6.28
        freq = 0.5 + torch.rand(n, 1, generator=g)
        self.x = torch.sin(freq * t + phase) + 0.1 * torch.randn(n, 64, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.x[idx]


class MetricTracker:
    def __init__(self, export_path: Path, export_every: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self._callbacks: list[Callable[[str, int, float], None]] = []
        self._export_path = export_path
        threading.Thread(
            target=self._export_loop, args=(export_every,), daemon=True, name="metrics-export"
        ).start()

    def add_callback(self, fn: Callable[[str, int, float], None]) -> None:
        self._callbacks.append(fn)

    def update(self, name: str, step: int, value: float) -> None:
        with self._lock:
            self._history[name].append((step, value))
            for fn in self._callbacks:
                fn(name, step, value)

    def best(self, name: str) -> float:
        with self._lock:
            return min((v for _, v in self._history[name]), default=float("inf"))

    def _export_loop(self, every: float) -> None:
        while True:
            time.sleep(every)
            with self._lock:
                snapshot = {k: list(v) for k, v in self._history.items()}
            self._export_path.write_text(json.dumps(snapshot))


class BestCheckpoint:
    def __init__(self, tracker: MetricTracker, model: nn.Module, path: Path) -> None:
        self.tracker, self.model, self.path = tracker, model, path

    def __call__(self, name: str, step: int, value: float) -> None:
        if name == "val_loss" and value <= self.tracker.best("val_loss"):
            torch.save(self.model.state_dict(), self.path)
            log.info("step %d: new best val_loss %.4f", step, value)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--eval-every", type=int, default=8)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    data = SensorWindows(4096, seed=args.seed)
    sampler = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
    )
    val_loader = DataLoader(SensorWindows(256, seed=args.seed + 1), batch_size=64)
    model = DDP(
        nn.Sequential(
            nn.Linear(64, 32),
            nn.Tanh(),
            nn.Linear(32, 8),
            nn.Tanh(),
            nn.Linear(8, 32),
            nn.Tanh(),
            nn.Linear(32, 64),
        )
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    tracker = MetricTracker(out_dir / f"metrics.rank{rank}.json")
    if rank == 0:
        tracker.add_callback(BestCheckpoint(tracker, model.module, out_dir / "best.pt"))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x in loader:
            heartbeat.beat(step)
            loss = nn.functional.mse_loss(model(x), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            tracker.update("train_loss", step, loss.item())
            if step % args.eval_every == 0:
                model.eval()
                with torch.no_grad():
                    val = sum(nn.functional.mse_loss(model(v), v).item() for v in val_loader) / len(
                        val_loader
                    )
                model.train()
                tracker.update("val_loss", step, all_reduce_mean(val))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
