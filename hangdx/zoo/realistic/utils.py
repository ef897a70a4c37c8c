"""What a training repo's utils.py holds: distributed set-up, logging, seeding, a heartbeat, tiny models.

Shared by the realistic hang-zoo programs (hangdx.zoo.realistic.train_*). Nothing here knows which
fault a program has; the only harness hooks are `allow_ptrace` (a no-op unless the demo asks) and the
simulated cgroup OOM killer, which runs only when the launcher sets HANGDX_ZOO_OOM_RANK.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hangdx.zoo.job import allow_ptrace, socket_fds

log = logging.getLogger("train")


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out-dir", default="runs/dev", help="checkpoints, metrics and the heartbeat go here")
    p.add_argument("--data-dir", default=None, help="default: OUT_DIR/data")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    return p


def setup_distributed() -> tuple[int, int]:
    """init_process_group from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    allow_ptrace()
    torch.set_num_threads(1)
    _maybe_start_oom_killer()
    dist.init_process_group("gloo", timeout=timedelta(hours=1))
    return dist.get_rank(), dist.get_world_size()


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: give every DataLoader worker its own, reproducible seed."""
    allow_ptrace()
    random.seed(torch.initial_seed() % 2**32)


class Heartbeat:
    """Writes the last step started to OUT_DIR/rank<r>.step, for the cluster's stall watchdog."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        self.path = out_dir / f"rank{rank}.step"
        self.tmp = out_dir / f".rank{rank}.step.tmp"

    def beat(self, step: int) -> None:
        self.tmp.write_text(f"{step}\n")
        os.replace(self.tmp, self.path)


def all_reduce_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


# --- the simulated cgroup OOM killer (harness, not training code) -----------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _maybe_start_oom_killer() -> None:
    """On the rank named by HANGDX_ZOO_OOM_RANK, act as the kernel's OOM killer for a small cgroup.

    When this process's RSS grows by more than HANGDX_ZOO_OOM_GROWTH_MB, SIGKILL it. Its sockets are
    first handed to a `sleep` holder so that gloo peers keep waiting, as NCCL peers would, instead of
    failing fast on "Connection closed by peer".
    """
    if os.environ.get("HANGDX_ZOO_OOM_RANK") != os.environ.get("RANK"):
        return
    growth = float(os.environ.get("HANGDX_ZOO_OOM_GROWTH_MB", "80"))
    workdir = Path(os.environ.get("HANGDX_ZOO_WORKDIR", "."))

    def watch() -> None:
        time.sleep(0.5)
        limit = _rss_mb() + growth
        while _rss_mb() < limit:
            time.sleep(0.002)
        holder = subprocess.Popen(
            ["sleep", "infinity"],
            pass_fds=socket_fds(),
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        (workdir / f"rank{os.environ['RANK']}.holder").write_text(f"{holder.pid}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="cgroup-oom-killer", daemon=True).start()
