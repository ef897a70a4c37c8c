"""DDP next-token MLP on a streaming IterableDataset: each rank reads its own tokenized shard files.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_streaming_shards --out-dir runs/stream

Shards are assigned round-robin to ranks (shards[rank::world]) and, within a rank, to DataLoader
workers. Each epoch ends with a barrier so that every rank starts validation together. Field fault:
the shards are of uneven length and rank 2's two are the short ones; rank 2 runs out of batches
first and waits in the end-of-epoch barrier while the other ranks, still in the epoch, wait for its
gradients in DDP's all-reduce inside loss.backward().
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

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
VOCAB = 256
CONTEXT = 8
# Samples per shard as written by the tokenizer job (the crawl of 2 and 6 was cut short).
SHARD_SIZES = [512, 480, 96, 512, 512, 480, 120, 512]


class TokenShards(IterableDataset):
    def __init__(self, shard_ids: list[int], seed: int) -> None:
        self.shard_ids = shard_ids
        self.seed = seed

    def read_shard(self, shard: int):
        g = torch.Generator().manual_seed(self.seed * 31 + shard)
        stream = torch.randint(0, VOCAB, (SHARD_SIZES[shard] + CONTEXT,), generator=g)
        stream[1::2] = (stream[0::2][: len(stream[1::2])] * 7 + 3) % VOCAB  # a learnable pattern
        for i in range(SHARD_SIZES[shard]):
            yield stream[i : i + CONTEXT], stream[i + CONTEXT]

    def __iter__(self):
        info = get_worker_info()
        mine = self.shard_ids if info is None else self.shard_ids[info.id :: info.num_workers]
        for shard in mine:
            yield from self.read_shard(shard)


class NextTokenMLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mlp = nn.Sequential(nn.Linear(CONTEXT * dim, 128), nn.GELU(), nn.Linear(128, VOCAB))

    def forward(self, ctx: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ctx).flatten(1))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(batch_size=16)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    my_shards = list(range(len(SHARD_SIZES)))[rank::world]
    loader = DataLoader(
        TokenShards(my_shards, seed=args.seed),
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
    )
    val_loader = DataLoader(TokenShards([rank], seed=args.seed + 1), batch_size=64)
    model = DDP(NextTokenMLP())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    log.info("rank %d reads shards %s", rank, my_shards)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for ctx, target in loader:
            heartbeat.beat(step)
            loss = nn.functional.cross_entropy(model(ctx), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 10 == 0 and rank == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        dist.barrier()  # every rank done with the epoch before validation
        model.eval()
        with torch.no_grad():
            val = sum(nn.functional.cross_entropy(model(c), t).item() for c, t in val_loader) / len(
                val_loader
            )
        val = all_reduce_mean(val)
        if rank == 0:
            log.info("epoch %d val loss %.4f", epoch, val)
            torch.save(model.module.state_dict(), out_dir / f"epoch{epoch}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
