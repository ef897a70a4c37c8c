"""FSDP (fully_shard) MLP-mixer-style classifier with sharded checkpoints (torch.distributed.checkpoint).

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_fsdp_checkpoint --out-dir runs/fsdp

The model's parameters are sharded across ranks. Every --ckpt-every steps every rank writes its
shards of the model and optimizer with dcp.save into checkpoints/step_N/ (one __<rank>_0.distcp file
per rank, then rank 0 writes the metadata). Field fault: the checkpoint directory is on a shared
file system whose server stops answering for rank 2's file; rank 2 blocks in open() inside dcp.save,
and the other ranks, their shards written, wait for it in dcp.save's closing collective.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from hangdx.zoo.realistic.utils import (
    Heartbeat,
    base_parser,
    seed_everything,
    seed_worker,
    setup_distributed,
    setup_logging,
)

log = logging.getLogger("train")


class PatchImages(Dataset):
    """Synthetic 16x16 images cut into 16 patches of 4x4x3, with a class-dependent pattern."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + idx)
        label = idx % 10
        image = torch.randn(3, 16, 16, generator=g) * 0.5
        image[:, label, :] += 1.0
        patches = image.unfold(1, 4, 4).unfold(2, 4, 4).permute(1, 2, 0, 3, 4).reshape(16, 48)
        return patches, label


class MixerBlock(nn.Module):
    def __init__(self, n_tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mix = nn.Sequential(nn.Linear(n_tokens, 32), nn.GELU(), nn.Linear(32, n_tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mix = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(48, dim)
        self.blocks = nn.ModuleList(MixerBlock(16, dim) for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.stem(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt-every", type=int, default=5)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    train_set = PatchImages(2048, seed=args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
        drop_last=True,
    )
    model = Mixer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for patches, labels in loader:
            heartbeat.beat(step)
            loss = nn.functional.cross_entropy(model(patches), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            step += 1
            if step % args.log_every == 0 and rank == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
            if step % args.ckpt_every == 0:
                model_state, optim_state = get_state_dict(model, opt)
                ckpt = out_dir / "checkpoints" / f"step_{step:06d}"
                dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=ckpt)
                if rank == 0:
                    log.info("saved %s", ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
