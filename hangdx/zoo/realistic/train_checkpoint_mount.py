"""DDP CNN with exactly-resumable checkpoints: every rank saves its own RNG and data-loader state.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_checkpoint_mount --out-dir runs/cnn

Every --ckpt-every steps rank 0 writes the model and optimizer, and every rank writes
checkpoints/step_N/rank_R_state.pt (its RNG states and position in the epoch) so that a restart
replays the same batches. Field fault: rank 2's checkpoint path is on a mount whose server hangs;
torch.save blocks in open() on rank 2, and the other ranks wait for it in DDP's all-reduce inside
the next loss.backward().
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

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


class NoisyShapes(Dataset):
    """Synthetic 3x16x16 images: a bright square whose position is the class, plus noise."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + idx)
        label = idx % 10
        image = 0.3 * torch.randn(3, 16, 16, generator=g)
        r, c = divmod(label, 4)
        image[:, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 1.0
        shift = random.randint(-1, 1)  # augmentation: a random horizontal jitter
        return torch.roll(image, shift, dims=2), label


def save_checkpoint(ckpt_dir: Path, step: int, rank: int, model: nn.Module, opt, sampler, epoch: int) -> None:
    step_dir = ckpt_dir / f"step_{step:06d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(
            {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step_dir / "model.pt"
        )
    state = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "epoch": epoch,
        "sampler_seed": sampler.seed,
        "step": step,
    }
    t0 = time.perf_counter()
    torch.save(state, step_dir / f"rank_{rank}_state.pt")
    log.info("saved %s in %.2fs", step_dir.name, time.perf_counter() - t0)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt-every", type=int, default=6)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed + rank)
    out_dir = Path(args.out_dir)
    ckpt_dir = out_dir / "checkpoints"
    heartbeat = Heartbeat(out_dir, rank)

    train_set = NoisyShapes(1024, seed=args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
        pin_memory=False,
    )
    torch.manual_seed(args.seed)
    model = DDP(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            heartbeat.beat(step)
            loss = criterion(model(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % args.log_every == 0:
                mean = all_reduce_mean(loss.item())
                if rank == 0:
                    log.info("epoch %d step %d loss %.4f", epoch, step, mean)
            if step % args.ckpt_every == 0:
                save_checkpoint(ckpt_dir, step, rank, model.module, opt, sampler, epoch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
