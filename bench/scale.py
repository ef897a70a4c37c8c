"""Big evidence: `hangdx analyze` time and peak memory against log size and rank count, grep as the floor.

    python bench/scale.py [--sizes 15,150,1500] [--ranks 64,1024,4096] [--folders 1024] [--repeat 3]

Logs are NCCL INFO logs of 8 ranks on 2 hosts in NCCL's own format (hangdx/zoo/biglog.py), rank 5 three
collectives behind; generated in a temporary folder (by a child process), deleted after. Each row: the verdict
(right when it is conditional_collective, rank 5), seconds of the whole `hangdx analyze` command (Python start-up
included; median of 3 runs, or --repeat; bytecode compiled as an installed package has it), its peak resident
memory, and `grep -c opCount` on the same file in the same run (median of as many). Rank rows: one py-spy dump per
rank, one rank (777, or the last) in torch.save while the others wait in all_reduce. Targets: the verdict right at every
size; time at most 2x grep; peak memory under 300 MB whatever the size; time linear in ranks. Folder rows: a
torchrun `--log-dir` tree per node (`node-NNN/<run>/attempt_0/<local rank>/stderr.log`, 8 local ranks a node) as
people gather them, every rank's watchdog timing out in its allreduce but rank 777, which ran out of GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYSPY = """Process {pid}: /usr/bin/python3.11 -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread {pid} (idle): "MainThread"
{frames}
"""
WAIT = "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n    train_step (train.py:41)\n"
# torch's own lines (c10d prefixes them with the global rank), as tests/fixtures/torch_log records them.
WATCHDOG = (
    "[rank{r}]:[E515 18:36:47.341808597 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=241, OpType=ALLREDUCE, NumelIn=6, NumelOut=6, Timeout(ms)=600000) ran for 600086 "
    "milliseconds before timing out.\n"
)
OOM = (
    "[rank{r}]: Traceback (most recent call last):\n"
    '[rank{r}]:   File "/workspace/train.py", line 41, in train_step\n'
    "[rank{r}]:     loss = model(batch).sum()\n"
    "[rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.35 GiB. GPU 3 has a total capacity "
    "of 63.42 GiB of which 1.70 GiB is free.\n"
)
SAVE = "    _save (torch/serialization.py:966)\n    save (torch/serialization.py:964)\n    save_checkpoint (train.py:60)\n"


ENV = dict(os.environ)  # set by main: hangdx runs as installed, its bytecode compiled once, not at every run
REPEAT = 3  # each figure is the median of this many runs


def run(args: list[str], stdin: Path | None = None) -> tuple[dict | None, float, float]:
    """(verdict, median seconds, peak MB of the process) over REPEAT runs."""
    runs = [_run_once(args, stdin) for _ in range(REPEAT)]
    return runs[-1][0], statistics.median(r[1] for r in runs), max(r[2] for r in runs)


def _run_once(args: list[str], stdin: Path | None = None) -> tuple[dict | None, float, float]:
    t0 = time.monotonic()
    with open(stdin, "rb") if stdin else open(os.devnull, "rb") as inp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hangdx", *args], stdin=inp, stdout=subprocess.PIPE, env=ENV
        )
        out = proc.stdout.read() if proc.stdout else b""
        _, _, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - t0
    try:
        return json.loads(out), seconds, usage.ru_maxrss / 1024
    except ValueError:
        return None, seconds, usage.ru_maxrss / 1024


def _write_log(path: Path, mb: int) -> Path:
    """The log of about `mb` MB, written by a child process. The peak memory the kernel reports for a child counts
    its parent's high-water mark at the fork (copied, then kept through exec): were this process to build a big log
    itself, every later row would show its peak, not hangdx's."""
    code = "import sys; from pathlib import Path; from hangdx.zoo import biglog; "
    code += "biglog.write(Path(sys.argv[1]), biglog.ops_for(int(sys.argv[2]) << 20))"
    subprocess.run([sys.executable, "-c", code, str(path), str(mb)], check=True, env=ENV)
    return path


def grep_seconds(path: Path) -> float:
    """Median seconds of `grep -c opCount` (its output read through a pipe: GNU grep stops at the first match
    when its output is /dev/null)."""
    times = []
    for _ in range(REPEAT):
        t0 = time.monotonic()
        subprocess.run(["grep", "-c", "opCount", str(path)], capture_output=True)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def verdict_cell(v: dict | None, rank: int) -> str:
    if not v or not v.get("root_cause"):
        return "no verdict"
    rc = v["root_cause"]
    right = rc["culprit"]["ranks"] == [rank]
    return f"{rc['category']} {rc['culprit']['ranks']} {'right' if right else 'WRONG'}"


def main() -> int:
    global REPEAT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="15,150,1500", help="log sizes in MB")
    ap.add_argument("--ranks", default="64,1024,4096")
    ap.add_argument("--folders", default="1024", help="ranks of torchrun --log-dir trees, 8 a node")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="runs per figure, the median quoted")
    args = ap.parse_args()
    REPEAT = max(1, args.repeat)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hangdx-scale-") as tmp:
        # As a user runs it: installed packages have their bytecode compiled (pip does it at install), whatever
        # PYTHONDONTWRITEBYTECODE this shell has; and the catalogue's compiled rows are in the user's cache. One
        # run first makes both.
        ENV.pop("PYTHONDONTWRITEBYTECODE", None)
        ENV["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        warm = Path(tmp) / "warm.log"
        warm.write_text(WATCHDOG.format(r=0))
        _run_once(["analyze", str(warm), "--json"])
        for mb in [int(x) for x in args.sizes.split(",") if x]:
            log = _write_log(Path(tmp) / f"nccl-{mb}mb.log", mb)
            size = log.stat().st_size / 2**20
            floor = grep_seconds(log)
            for how in ("file", "stdin"):
                v, secs, peak = (
                    run(["analyze", str(log), "--json"])
                    if how == "file"
                    else run(["analyze", "-", "--json"], stdin=log)
                )
                rows.append((f"{size:,.0f} MB log ({how})", verdict_cell(v, 5), secs, peak, floor))
            log.unlink()
        for n in [int(x) for x in args.ranks.split(",") if x]:
            d = Path(tmp) / f"ranks-{n}"
            d.mkdir()
            culprit = 777 if n > 777 else n - 1
            for r in range(n):
                text = PYSPY.format(pid=10000 + r, frames=SAVE if r == culprit else WAIT)
                (d / f"rank{r}.txt").write_text(text)
            v, secs, peak = run(["analyze", str(d), "--json"])
            rows.append((f"{n:,} py-spy dumps", verdict_cell(v, culprit), secs, peak, None))
        for n in [int(x) for x in args.folders.split(",") if x]:
            d = Path(tmp) / f"logdirs-{n}"
            culprit = 777 if n > 777 else n - 1
            for r in range(n):
                f = d / f"node-{r // 8:03d}" / "run_0" / "attempt_0" / str(r % 8) / "stderr.log"
                f.parent.mkdir(parents=True)
                f.write_text((OOM if r == culprit else WATCHDOG).format(r=r))
            v, secs, peak = run(["analyze", str(d), "--json"])
            rows.append((f"{n:,} torchrun log folders", verdict_cell(v, culprit), secs, peak, None))
    print(f"{'input':26} {'verdict':40} {'seconds':>8} {'peak MB':>8} {'grep -c s':>10} {'x grep':>7}")
    print("-" * 104)
    for name, verdict, secs, peak, floor in rows:
        ratio = f"{secs / floor:7.1f}" if floor else "      -"
        fl = f"{floor:10.2f}" if floor else "         -"
        print(f"{name:26} {verdict:40} {secs:8.2f} {peak:8.1f} {fl} {ratio}")
    print("-" * 104)
    print("targets: verdict right at every size; <= 2x grep -c; < 300 MB; time linear in ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
