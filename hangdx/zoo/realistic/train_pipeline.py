"""Pipeline-parallel MLP: one stage per rank, micro-batches, a hand-written 1F1B schedule.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_pipeline --out-dir runs/pp

Rank 0 reads the data and runs the first stage, the last rank computes the loss; activations go
down the pipeline and gradients come back up with dist.send / dist.recv. The schedule is 1F1B
(warm-up forwards, then one forward and one backward alternately) to bound activation memory.
Field fault: it was written with blocking send/recv in the textbook order, so once the last stage
sends back its first gradient while stage 2 sends down its next activation, both wait for the
other to receive (gloo and NCCL sends both need the matching recv); stages 0 and 1 wait behind them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hangdx.zoo.realistic.utils import (
    Heartbeat,
    base_parser,
    seed_everything,
    seed_worker,
    setup_distributed,
    setup_logging,
)

log = logging.getLogger("train")
HIDDEN = 64
IN_FEATURES = 20
N_CLASSES = 5


class Blobs(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.centers = torch.randn(N_CLASSES, IN_FEATURES, generator=g) * 2
        self.labels = torch.randint(0, N_CLASSES, (n,), generator=g)
        self.x = self.centers[self.labels] + torch.randn(n, IN_FEATURES, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.labels[idx]


def build_stage(rank: int, world: int) -> nn.Module:
    d_in = IN_FEATURES if rank == 0 else HIDDEN
    if rank == world - 1:
        return nn.Sequential(nn.Linear(d_in, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))
    return nn.Sequential(nn.Linear(d_in, HIDDEN), nn.ReLU(), nn.LayerNorm(HIDDEN))


class PipelineStage:
    def __init__(self, module: nn.Module, rank: int, world: int, micro_batch: int) -> None:
        self.module = module
        self.rank = rank
        self.world = world
        self.is_first = rank == 0
        self.is_last = rank == world - 1
        self.act_shape = (micro_batch, HIDDEN)

    def recv_forward(self, micro: torch.Tensor | None) -> torch.Tensor:
        if self.is_first:
            return micro
        buf = torch.empty(self.act_shape)
        dist.recv(buf, src=self.rank - 1)
        return buf.requires_grad_()

    def send_forward(self, out: torch.Tensor) -> None:
        if not self.is_last:
            dist.send(out.detach(), dst=self.rank + 1)

    def recv_backward(self) -> torch.Tensor | None:
        if self.is_last:
            return None
        grad = torch.empty(self.act_shape)
        dist.recv(grad, src=self.rank + 1)
        return grad

    def send_backward(self, inp: torch.Tensor) -> None:
        if not self.is_first:
            dist.send(inp.grad, dst=self.rank - 1)

    def forward_step(self, x: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        out = self.module(x)
        if self.is_last:
            return nn.functional.cross_entropy(out, target)
        return out

    def backward_step(self, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        if self.is_last:
            out.backward()
        else:
            out.backward(grad)


def train_step_1f1b(stage: PipelineStage, micro_x: list, micro_y: list) -> float:
    """One optimizer step over len(micro_x) micro-batches, 1F1B order."""
    n_micro = len(micro_x)
    n_warmup = min(stage.world - stage.rank - 1, n_micro)
    inputs, outputs, losses = [], [], []

    def forward(i: int) -> None:
        x = stage.recv_forward(micro_x[i] if stage.is_first else None)
        out = stage.forward_step(x, micro_y[i] if stage.is_last else None)
        stage.send_forward(out)
        inputs.append(x)
        outputs.append(out)
        if stage.is_last:
            losses.append(out.item())

    def backward() -> None:
        grad = stage.recv_backward()
        x, out = inputs.pop(0), outputs.pop(0)
        stage.backward_step(out, grad)
        stage.send_backward(x)

    for i in range(n_warmup):
        forward(i)
    for i in range(n_warmup, n_micro):
        forward(i)
        backward()
    for _ in range(n_warmup):
        backward()
    return sum(losses) / max(len(losses), 1)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--ckpt-every", type=int, default=50)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed + rank)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    micro = args.batch_size
    stage = PipelineStage(build_stage(rank, world), rank, world, micro)
    opt = torch.optim.Adam(stage.module.parameters(), lr=args.lr)
    loader = None
    if stage.is_first or stage.is_last:  # the first stage needs the inputs, the last the labels
        g = torch.Generator().manual_seed(args.seed)
        loader = DataLoader(
            Blobs(2048, seed=args.seed),
            batch_size=micro * args.micro_batches,
            shuffle=True,
            generator=g,
            num_workers=1,
            worker_init_fn=seed_worker,
            drop_last=True,
        )
    log.info("stage %d/%d: %s", rank, world, stage.module)

    step = 0
    for epoch in range(args.epochs):
        batches = iter(loader) if loader is not None else iter(lambda: (None, None), object())
        for _ in range(2048 // (micro * args.micro_batches)):
            heartbeat.beat(step)
            x, y = next(batches)
            micro_x = list(x.chunk(args.micro_batches)) if x is not None else [None] * args.micro_batches
            micro_y = list(y.chunk(args.micro_batches)) if y is not None else [None] * args.micro_batches
            opt.zero_grad()
            loss = train_step_1f1b(stage, micro_x, micro_y)
            opt.step()
            if stage.is_last and step % args.log_every == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss)
            step += 1
            if step % args.ckpt_every == 0:
                torch.save(stage.module.state_dict(), out_dir / f"stage{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
