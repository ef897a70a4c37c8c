"""Realistic hung training programs: the hang zoo's held-out set.

The eleven scenarios of hangdx.zoo.job were written alongside hangdx's rules. These programs are
written the way ML engineers write training scripts (a model, an optimizer, a Dataset and a
DataLoader with workers, DDP or a pipeline, evaluation, checkpoints, logging), and each hangs for one
reason seen in the field. They leave no marker of where they hang: like a cluster's stall watchdog,
the launcher waits until every rank's heartbeat (OUT_DIR/rank<r>.step) has gone quiet.

`prepare(name, workdir, world_size)` builds the world a program runs in (its data files, a storage
path that never answers) before the ranks start; it imports no torch, so neither does the launcher.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

# Samples of the image datasets: 3x16x16 float32 pixels, then an int32 label.
IMAGE_SHAPE = (3, 16, 16)
IMAGE_RECORD = struct.Struct(f"<{3 * 16 * 16}fi")


def _lcg(seed: int):
    """A small deterministic generator (no numpy/torch in the launcher)."""
    state = seed & 0xFFFFFFFF
    while True:
        state = (1103515245 * state + 12345) & 0x7FFFFFFF
        yield state / 0x7FFFFFFF


def write_image_dataset(root: Path, n: int, seed: int = 0) -> None:
    """n raw records `sample-00000.bin` ...: the class shows as a brighter colour channel band."""
    root.mkdir(parents=True, exist_ok=True)
    rnd = _lcg(seed)
    for i in range(n):
        label = i % 10
        pixels = [next(rnd) - 0.5 for _ in range(3 * 16 * 16)]
        for j in range(label * 16, label * 16 + 16):  # a class-dependent stripe
            pixels[j] += 1.0
        (root / f"sample-{i:05d}.bin").write_bytes(IMAGE_RECORD.pack(*pixels, label))


def hung_file(path: Path) -> None:
    """Make `path` a FIFO: opening it blocks until a peer opens the other end, which nobody will.

    This stands in for a file on a hung NFS/FUSE mount (a server that stopped answering).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _prepare_ddp_nfs_dataloader(workdir: Path, world_size: int) -> None:
    root = workdir / "data" / "train"
    write_image_dataset(root, 256)
    # One file sits on an NFS server that stopped answering: opening it never returns. With
    # DistributedSampler(shuffle=False) and batch 8, rank 1's 4th batch (step 3) holds index
    # 1 + world_size * (3 * 8 + 2).
    stale = root / f"sample-{1 + world_size * (3 * 8 + 2):05d}.bin"
    hung_file(stale)


def _prepare_rank_state_checkpoint(workdir: Path, world_size: int) -> None:
    # Rank 2's node-local scratch path for the step-6 checkpoint is on a hung mount (a FIFO: the
    # open() for writing waits for a reader that never comes).
    hung_file(workdir / "checkpoints" / "step_000006" / "rank_2_state.pt")


def _prepare_dcp_checkpoint(workdir: Path, world_size: int) -> None:
    # The step-5 checkpoint: rank 2's shard file sits on a server that stopped answering.
    hung_file(workdir / "checkpoints" / "step_000005" / "__2_0.distcp")


def _prepare_async_checkpoint(workdir: Path, world_size: int) -> None:
    # The checkpoint volume stops answering at the first write (step 3).
    hung_file(workdir / "checkpoints" / "step_000003.pt")


def _prepare_nothing(workdir: Path, world_size: int) -> None:
    pass


PREPARE = {
    "real_dataloader_nfs": _prepare_ddp_nfs_dataloader,
    "real_eval_worker_died": _prepare_nothing,
    "real_checkpoint_hung_mount": _prepare_rank_state_checkpoint,
    "real_early_stopping": _prepare_nothing,
    "real_pipeline_1f1b": _prepare_nothing,
    "real_multitask_unused": _prepare_nothing,
    "real_long_sequence_oom": _prepare_nothing,
    "real_slow_augmentation": _prepare_nothing,
    "real_fsdp_dcp_hung_mount": _prepare_dcp_checkpoint,
    "real_async_checkpoint": _prepare_async_checkpoint,
    "real_prefetch_thread_died": _prepare_nothing,
    "real_uneven_streaming_shards": _prepare_nothing,
    "real_callback_relock": _prepare_nothing,
}


def prepare(name: str, workdir: Path, world_size: int) -> None:
    PREPARE[name](Path(workdir), world_size)
