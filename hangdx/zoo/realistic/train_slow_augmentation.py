"""DDP CNN on images from several camera types, resized and blurred on the fly by the Dataset.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_slow_augmentation --out-dir runs/cam

Each rank reads the shards of one camera. Field fault (a straggler, not a hang): rank 1's camera
records 512x512 frames where the others record 16x16 thumbnails, and the Dataset blurs and resizes
every frame in the DataLoader worker. Rank 1's single worker cannot keep up, so every step waits for
rank 1's batch: the job advances, at rank 1's pace.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
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
CAMERA_RESOLUTION = {0: 16, 1: 512, 2: 16, 3: 16}  # by shard (= rank): camera type of each site


def gaussian_kernel(size: int = 9, sigma: float = 2.0) -> torch.Tensor:
    x = torch.arange(size) - size // 2
    k = torch.exp(-(x**2) / (2 * sigma**2))
    k2 = torch.outer(k, k) / k.sum() ** 2
    return k2.expand(3, 1, size, size).contiguous()


class CameraFrames(Dataset):
    def __init__(self, shard: int, n: int, out_size: int = 16) -> None:
        self.shard = shard
        self.n = n
        self.res = CAMERA_RESOLUTION[shard]
        self.out_size = out_size
        self.kernel = gaussian_kernel()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.shard * 1_000_003 + idx)
        label = idx % 10
        frame = torch.rand(1, 3, self.res, self.res, generator=g)  # "decoded" frame
        frame[:, label % 3] += 0.5
        if self.res != self.out_size:
            frame = F.conv2d(frame, self.kernel, padding=4, groups=3)  # anti-alias before downscaling
            frame = F.interpolate(frame, size=(self.out_size, self.out_size), mode="bilinear", antialias=True)
        return frame[0], label


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    loader = DataLoader(
        CameraFrames(shard=rank, n=100_000),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=1,
        worker_init_fn=seed_worker,
        drop_last=True,
    )
    model = DDP(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    step = 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        for images, labels in loader:
            heartbeat.beat(step)
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % args.log_every == 0:
                mean = all_reduce_mean(loss.item())
                if rank == 0:
                    log.info(
                        "epoch %d step %d loss %.4f %.2fs/step",
                        epoch,
                        step,
                        mean,
                        (time.perf_counter() - t0) / args.log_every,
                    )
                t0 = time.perf_counter()
            if step % 1000 == 0 and rank == 0:
                torch.save(model.module.state_dict(), out_dir / "last.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
