"""NCCL debug logs of any size, for the big-evidence tests and bench/scale.py (never committed: generated).

Lines are NCCL's own format (as in tests/fixtures/nccl_log/): per process a version line and an `Init COMPLETE`
line mapping its communicator to its rank (unless `mapping=False`), then one `AllReduce: opCount` line per rank
and collective, with rank `behind` stopping `lag` collectives before the others. 8 ranks on 2 hosts.
"""

from __future__ import annotations

from pathlib import Path

COMM = {r: f"0x55d4c8a1e{r:03x}" for r in range(8)}
PROCS = [(f"gpu-node-0{r // 4}", 1000 + r, r % 4, r) for r in range(8)]
LINE_BYTES = 213  # about, per collective line


def write(path: Path, ops: int, mapping: bool = True, behind: int = 5, lag: int = 3) -> Path:
    with path.open("wb") as f:
        if mapping:
            for h, pid, dev, _r in PROCS:
                f.write(f"{h}:{pid}:{pid} [{dev}] NCCL INFO NCCL version 2.21.5+cuda12.4\n".encode())
            for h, pid, dev, r in PROCS:
                f.write(
                    f"{h}:{pid}:{pid} [{dev}] NCCL INFO comm {COMM[r]} rank {r} nranks 8 cudaDev {dev} "
                    f"nvmlDev {dev} busId 1b000 commId 0x5ae77eb5ea4ec1ee - Init COMPLETE\n".encode()
                )

        def block(first: int, last: int, skip_behind: bool) -> bytes:
            out = []
            for op in range(first, last):
                for h, pid, dev, r in PROCS:
                    if skip_behind and r == behind:
                        continue
                    out.append(
                        f"{h}:{pid}:{pid} [{dev}] NCCL INFO AllReduce: opCount {op:x} sendbuff 0x7f3bfe7f5400 "
                        f"recvbuff 0x7f3bfe7f5400 count 7382228 datatype 9 op 0 root 0 comm {COMM[r]} "
                        f"[nranks=8] stream 0x55d4c7f0e5e0\n"
                    )
            return "".join(out).encode()

        step = 20000
        for start in range(0, ops - lag, step):
            f.write(block(start, min(start + step, ops - lag), False))
        f.write(block(ops - lag, ops, True))
    return path


def ops_for(size_bytes: int) -> int:
    """How many collectives make a log of about this size."""
    return max(10, size_bytes // (LINE_BYTES * len(PROCS)))
