"""DDP tabular regression (an MLP on sensor features) with early stopping on the validation loss.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_early_stopping --out-dir runs/mlp

Each rank validates on its own slice of the validation set (the sets are stored site by site) and
feeds its *local* validation loss to EarlyStopping; nobody all-reduces it. Field fault: rank 3's
slice is the one site whose labels were exported with the wrong sign, so its loss rises while the
others' falls; rank 3 alone stops early and waits in the final barrier, while the other ranks start
the next epoch and wait for it in DDP's all-reduce inside loss.backward().
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
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
N_FEATURES = 12


def sensor_data(n: int, seed: int, sign: float = 1.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    w = torch.linspace(-1, 1, N_FEATURES)
    x = torch.randn(n, N_FEATURES, generator=g)
    y = sign * (x @ w + 0.3 * torch.sin(3 * x[:, 0])) + 0.05 * torch.randn(n, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


def validation_sites(seed: int) -> torch.utils.data.ConcatDataset:
    # Four sites, 32 rows each; site 3's export flipped the label sign.
    return torch.utils.data.ConcatDataset(
        [sensor_data(32, seed + 10 + site, sign=-1.0 if site == 3 else 1.0) for site in range(4)]
    )


class EarlyStopping:
    def __init__(self, patience: int = 2, min_delta: float = 1e-3) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.best = float("inf")
        self.bad_epochs = 0

    def step(self, metric: float) -> bool:
        if metric < self.best - self.min_delta:
            self.best = metric
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
        return self.bad_epochs >= self.patience


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--patience", type=int, default=2)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    train_set = sensor_data(256, args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(
        train_set, batch_size=16, sampler=sampler, num_workers=1, worker_init_fn=seed_worker, drop_last=True
    )
    val_set = validation_sites(args.seed)
    per_rank = len(val_set) // world
    val_loader = DataLoader(Subset(val_set, range(rank * per_rank, (rank + 1) * per_rank)), batch_size=32)

    model = DDP(
        nn.Sequential(nn.Linear(N_FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    stopper = EarlyStopping(patience=args.patience)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            heartbeat.beat(step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        model.eval()
        with torch.no_grad():
            val_loss = sum(nn.functional.mse_loss(model(x), y, reduction="sum").item() for x, y in val_loader)
        val_loss /= per_rank
        log.info("epoch %d train loss %.4f val loss %.4f", epoch, loss.item(), val_loss)
        if stopper.step(val_loss):
            log.info("early stopping at epoch %d (best val loss %.4f)", epoch, stopper.best)
            break

    dist.barrier()  # everyone done before rank 0 writes the final model
    if rank == 0:
        torch.save(model.module.state_dict(), out_dir / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
