"""DDP text classifier (embedding bag + MLP) that overlaps data loading with a background thread.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_background_prefetch --out-dir runs/text

The DataLoader is wrapped in a BackgroundGenerator (the prefetch_generator recipe): a thread pulls
batches into a bounded queue and the training loop takes them out. Field fault: a record in rank 1's
shard is corrupt (its label is missing). The KeyError travels from the DataLoader worker into the
prefetch thread, which dies with a traceback on stderr; nothing tells the training loop, which waits
on the empty queue forever. The other ranks wait for rank 1 in DDP's all-reduce inside
loss.backward().
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

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
VOCAB = 500
LABELS = {"neg": 0, "neu": 1, "pos": 2}


class JsonlShard(Dataset):
    """Records as parsed from a JSONL shard: {"tokens": [...], "label": "pos"}."""

    def __init__(self, shard: int, n: int) -> None:
        g = torch.Generator().manual_seed(shard)
        self.records = []
        for i in range(n):
            label = ("neg", "neu", "pos")[i % 3]
            tokens = torch.randint(0, VOCAB, (12,), generator=g)
            tokens[:3] = 100 * LABELS[label] + torch.arange(3)
            self.records.append({"tokens": tokens.tolist(), "label": label})
        if shard == 1:
            self.records[37] = {"tokens": self.records[37]["tokens"]}  # a record exported without its label

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        rec = self.records[idx]
        return torch.tensor(rec["tokens"]), LABELS[rec["label"]]


class BackgroundGenerator(threading.Thread):
    """Prefetch items of a generator in a daemon thread (after the prefetch_generator package)."""

    def __init__(self, generator, max_prefetch: int = 4) -> None:
        super().__init__(daemon=True, name="prefetch")
        self.queue: queue.Queue = queue.Queue(max_prefetch)
        self.generator = generator
        self.start()

    def run(self) -> None:
        for item in self.generator:
            self.queue.put(item)
        self.queue.put(None)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if item is None:
            raise StopIteration
        return item


class TextClassifier(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, len(LABELS)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    loader = DataLoader(
        JsonlShard(shard=rank, n=256),
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
    )
    model = DDP(TextClassifier())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        for tokens, labels in BackgroundGenerator(loader):
            heartbeat.beat(step)
            loss = nn.functional.cross_entropy(model(tokens), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
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
