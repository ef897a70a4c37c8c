"""DDP GPT-style language model on variable-length documents, padded per batch (no truncation).

    torchrun --nproc-per-node 4 -m hangdx.zoo.realistic.train_long_sequence --out-dir runs/gpt

The collate function pads every batch to its longest document and the attention is written out by
hand (scores = q @ k^T), so memory grows with the square of the longest document in the batch.
Field fault: rank 2's shard holds one scraped page that is a whole log file (1,536 tokens, where
documents are usually under 64). Its attention scores blow through the container's memory limit and
the kernel OOM-kills rank 2 in the middle of the forward pass; the other ranks wait for its gradients
in DDP's all-reduce inside loss.backward().
"""

from __future__ import annotations

import logging
import math
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
VOCAB = 128
PAD = 0
LONG_DOC_INDEX = 2 + 4 * 13  # in rank 2's 4th batch of 4 (DistributedSampler, no shuffle, 4 ranks)


class ScrapedDocs(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + idx)
        length = 1536 if idx == LONG_DOC_INDEX else int(torch.randint(20, 64, (), generator=g))
        return torch.randint(1, VOCAB, (length,), generator=g)


def pad_collate(docs: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(docs, batch_first=True, padding_value=PAD)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_heads)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d_model: int = 32, n_heads: int = 4, n_layers: int = 2, max_len: int = 4096) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])
        return self.head(self.ln_f(self.blocks(self.tok(tokens) + self.pos(pos))))


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rank, world = setup_distributed()
    setup_logging(rank)
    seed_everything(args.seed)
    out_dir = Path(args.out_dir)
    heartbeat = Heartbeat(out_dir, rank)

    docs = ScrapedDocs(4096, seed=args.seed)
    sampler = DistributedSampler(docs, shuffle=False)
    loader = DataLoader(
        docs, batch_size=4, sampler=sampler, collate_fn=pad_collate, num_workers=1, worker_init_fn=seed_worker
    )
    model = DDP(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for tokens in loader:
            heartbeat.beat(step)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), ignore_index=PAD
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % args.log_every == 0:
                log.info("epoch %d step %d seq %d loss %.4f", epoch, step, tokens.shape[1], loss.item())
            step += 1
            if step % 500 == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "step": step}, out_dir / "ckpt.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
