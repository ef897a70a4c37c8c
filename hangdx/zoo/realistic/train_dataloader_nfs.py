"""DDP image classifier reading raw sample files from a shared (NFS) dataset directory.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_dataloader_nfs --out-dir runs/cnn

Field fault: one sample file lives on an NFS server that stopped answering. The DataLoader worker of
the rank that reads it blocks in open() forever; that rank waits for the batch in the DataLoader
while every other rank waits for its gradients in DDP's all-reduce inside loss.backward().
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from hangdx.zoo.realistic import IMAGE_RECORD, IMAGE_SHAPE
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


class RawImageFolder(Dataset):
    """One binary record per file: float32 pixels then an int32 label."""

    def __init__(self, root: Path, train: bool = True) -> None:
        self.files = sorted(root.glob("sample-*.bin"))
        self.train = train

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        with open(self.files[idx], "rb") as f:
            record = IMAGE_RECORD.unpack(f.read(IMAGE_RECORD.size))
        image = torch.tensor(record[:-1]).view(IMAGE_SHAPE)
        if self.train and torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, record[-1]


def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += (model(images).argmax(1) == labels).sum().item()
            total += labels.numel()
    model.train()
    return all_reduce_mean(correct / max(total, 1))


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    data_dir = Path(args.data_dir or out_dir / "data")
    heartbeat = Heartbeat(out_dir, rank)

    train_set = RawImageFolder(data_dir / "train")
    sampler = DistributedSampler(train_set, shuffle=False)  # the files are stored pre-shuffled
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        worker_init_fn=seed_worker,
        persistent_workers=True,
        drop_last=True,
    )
    val_loader = DataLoader(
        RawImageFolder(data_dir / "train", train=False), batch_size=32, sampler=DistributedSampler(train_set)
    )
    model = DDP(SmallCNN())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    log.info("training on %d samples, %d steps/epoch", len(train_set), len(loader))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for images, labels in loader:
            heartbeat.beat(step)
            loss = criterion(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % args.log_every == 0:
                mean = all_reduce_mean(loss.item())
                if rank == 0:
                    log.info(
                        "epoch %d step %d loss %.4f (%.2fs/step)", epoch, step, mean, time.perf_counter() - t0
                    )
                t0 = time.perf_counter()
            step += 1
        acc = evaluate(model, val_loader)
        if rank == 0:
            log.info("epoch %d val acc %.3f", epoch, acc)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, out_dir / "last.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
