"""DDP multi-task image model: a shared encoder, a class head and an auxiliary attribute head.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_multitask --out-dir runs/mt

The attribute loss is added only when a batch carries attribute labels (-1 means "unlabelled").
Each rank reads its own shards. Field fault: rank 1's shards come from the web-crawl source, which
has no attribute labels, so rank 1 never runs the attribute head. DDP was built with the default
find_unused_parameters=False: the bucket holding that head's gradients is never reduced on rank 1,
and the other ranks wait for it in DDP's all-reduce inside loss.backward(). Rank 1's next forward
raises DDP's "Expected to have finished reduction in the prior iteration", but its process never
exits: the interpreter waits for the (non-daemon) metrics-uploader thread.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from hangdx.zoo.realistic.utils import (
    Heartbeat,
    SmallCNN,
    all_reduce_mean,
    base_parser,
    seed_everything,
    seed_worker,
    setup_distributed,
    setup_logging,
)

log = logging.getLogger("train")
N_ATTRIBUTES = 4
# Shards by source: the curated ones have attribute labels, the web-crawl ones do not.
# The manifest lists them in the order they were ingested; rank r reads SHARDS[r::world].
SHARDS = [("curated", 0), ("webcrawl", 0), ("curated", 1), ("curated", 2)]
SHARDS += [("curated", 3), ("webcrawl", 1), ("curated", 4), ("curated", 5)]


class ShardedImages(Dataset):
    def __init__(self, shards: list[tuple[str, int]], per_shard: int = 64) -> None:
        self.items = [(source, shard, j) for source, shard in shards for j in range(per_shard)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        source, shard, j = self.items[idx]
        g = torch.Generator().manual_seed(hash((source, shard, j)) % 2**31)
        label = j % 10
        image = torch.randn(3, 16, 16, generator=g) * 0.5
        image[label % 3] += 0.5
        if source == "curated":
            attrs = (torch.arange(N_ATTRIBUTES) == label % N_ATTRIBUTES).float()
        else:
            attrs = torch.full((N_ATTRIBUTES,), -1.0)
        return image, label, attrs


class MultiTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = SmallCNN().features
        self.cls_head = nn.Linear(16, 10)
        self.attr_head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, N_ATTRIBUTES))

    def forward(
        self, images: torch.Tensor, want_attributes: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        feats = self.encoder(images).flatten(1)
        attrs = self.attr_head(feats) if want_attributes else None
        return self.cls_head(feats), attrs


class MetricsUploader(threading.Thread):
    """Ships metrics to the experiment tracker in the background, batching them every few seconds."""

    def __init__(self, path: Path, interval: float = 5.0) -> None:
        super().__init__(name="metrics-uploader")
        self.path = path
        self.interval = interval
        self.queue: queue.Queue[dict] = queue.Queue()

    def log(self, **metrics: float) -> None:
        self.queue.put(metrics)

    def run(self) -> None:
        pending = []
        last = time.monotonic()
        while True:
            pending.append(self.queue.get())
            if time.monotonic() - last > self.interval:
                with self.path.open("a") as f:
                    f.writelines(json.dumps(m) + "\n" for m in pending)
                pending, last = [], time.monotonic()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--attr-weight", type=float, default=0.5)
    parser.set_defaults(log_every=10)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)
    tracker = MetricsUploader(out_dir / f"metrics.rank{rank}.jsonl")
    tracker.start()

    my_shards = SHARDS[rank::world]
    log.info("reading shards %s", my_shards)
    loader = DataLoader(
        ShardedImages(my_shards),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
        drop_last=True,
    )
    model = DDP(MultiTaskNet())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        for images, labels, attrs in loader:
            heartbeat.beat(step)
            has_attrs = bool((attrs[:, 0] >= 0).any())
            logits, attr_logits = model(images, want_attributes=has_attrs)
            loss = nn.functional.cross_entropy(logits, labels)
            if has_attrs:
                labelled = attrs[:, 0] >= 0
                loss = loss + args.attr_weight * nn.functional.binary_cross_entropy_with_logits(
                    attr_logits[labelled], attrs[labelled]
                )
            opt.zero_grad()
            loss.backward()
            opt.step()
            tracker.log(step=step, loss=loss.item())
            step += 1
            if step % args.log_every == 0:
                mean = all_reduce_mean(loss.item())
                if rank == 0:
                    log.info("epoch %d step %d loss %.4f", epoch, step, mean)
        if rank == 0:
            torch.save(model.module.state_dict(), out_dir / "last.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
