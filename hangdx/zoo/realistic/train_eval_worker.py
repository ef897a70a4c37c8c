"""DDP character-level transformer LM with asynchronous evaluation in a side process on rank 0.

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_eval_worker --out-dir runs/lm

Rank 0 starts an evaluator process up front; every --eval-every steps it ships the weights to it and
waits for the validation perplexity so that it can keep the best checkpoint. Field fault: the
evaluator dies on its first job (its validation loader has drop_last=True and a batch larger than the
validation split, so it divides by zero batches). Rank 0 waits on the result queue forever; the other
ranks wait for it in the next step's forward, where DDP broadcasts the model's buffers (the causal
mask) from rank 0.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
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
VOCAB = 64
SEQ_LEN = 32


class TokenWindows(Dataset):
    """Fixed-length windows of a synthetic token stream (a noisy repeating grammar)."""

    def __init__(self, n_windows: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.arange(n_windows * SEQ_LEN + 1) % 17
        noise = torch.randint(0, VOCAB, base.shape, generator=g)
        keep = torch.rand(base.shape, generator=g) < 0.9
        self.stream = torch.where(keep, base, noise)
        self.n = n_windows

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.stream[idx * SEQ_LEN : (idx + 1) * SEQ_LEN + 1]
        return chunk[:-1], chunk[1:]


class TinyLM(nn.Module):
    def __init__(self, d_model: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(SEQ_LEN, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d_model, VOCAB)
        self.register_buffer(
            "causal", nn.Transformer.generate_square_subsequent_mask(SEQ_LEN), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        return self.lm_head(self.blocks(h, mask=self.causal, is_causal=True))


def evaluation_worker(jobs: mp.Queue, results: mp.Queue, val_windows: int, batch_size: int) -> None:
    """Runs in its own process: evaluate every state dict it is sent, answer (step, perplexity)."""
    torch.set_num_threads(1)
    model = TinyLM()
    val_loader = DataLoader(TokenWindows(val_windows, seed=99), batch_size=batch_size, drop_last=True)
    while True:
        job = jobs.get()
        if job is None:
            return
        step, state = job
        model.load_state_dict(state)
        model.eval()
        total, batches = 0.0, 0
        with torch.no_grad():
            for x, y in val_loader:
                total += nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                batches += 1
        results.put((step, math.exp(total / batches)))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    args = parser.parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    evaluator = jobs = results = None
    if rank == 0:
        ctx = mp.get_context("spawn")
        jobs, results = ctx.Queue(), ctx.Queue()
        evaluator = ctx.Process(
            target=evaluation_worker, args=(jobs, results, 48, args.eval_batch_size), daemon=True
        )
        evaluator.start()
        log.info("evaluator started (pid %d)", evaluator.pid)

    train_set = TokenWindows(512, seed=args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed)
    loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, num_workers=1, worker_init_fn=seed_worker
    )
    model = DDP(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    best_ppl = float("inf")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            heartbeat.beat(step)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % args.log_every == 0:
                log.info(
                    "epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(), sched.get_last_lr()[0]
                )
            step += 1
            if rank == 0 and step % args.eval_every == 0:
                state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
                jobs.put((step, state))
                eval_step, ppl = results.get()  # wait for the verdict before deciding what to keep
                log.info("step %d val perplexity %.2f", eval_step, ppl)
                if ppl < best_ppl:
                    best_ppl = ppl
                    torch.save(model.module.state_dict(), out_dir / "best.pt")
    if rank == 0:
        jobs.put(None)
        evaluator.join()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
