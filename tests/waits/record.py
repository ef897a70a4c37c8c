"""Record real py-spy dumps of tests/waits/stuck.py: `python tests/waits/record.py MODE [WORLD] [--native] [--locals]`.

With --diagnose it prints `hangdx diagnose --local --json` of the live job instead (HANGDX_JOB_ID names it).

Starts WORLD ranks (gloo, CPU), waits until every rank wrote its marker, waits a few seconds more so each rank
sits in its wait, runs `py-spy dump` on each (its output verbatim, one file per rank) into
tests/fixtures/pyspy/waits/MODE/rank<r>.txt, then kills the ranks it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "fixtures" / "pyspy" / "waits"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stuck_job(mode: str, world: int) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """Start the job, yield (its HANGDX_JOB_ID, its rank processes) once every rank sits in its wait, kill it after."""
    work = Path(tempfile.mkdtemp(prefix=f"waits-{mode}-"))
    if mode == "storage":
        os.mkfifo(work / "ckpt.pt")
    port = free_port()
    job_id = f"waits-{mode}-{port}"
    procs = []
    try:
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HANGDX_JOB_ID=job_id)  # fmt: skip
            # Each rank leads its own process group, so that its DataLoader worker goes with it.
            cmd = [sys.executable, str(HERE / "stuck.py"), mode, str(work)]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))  # fmt: skip
        deadline = time.time() + 120
        while not all((work / f"rank{r}.stuck").exists() for r in range(world)):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"ranks did not reach their wait: {[p.poll() for p in procs]}")
            time.sleep(0.5)
        time.sleep(5)
        yield job_id, procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


def diagnose(job_id: str) -> dict:
    cmd = [sys.executable, "-m", "hangdx", "diagnose", job_id, "--local", "--json"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    mode, world = args[0], int(args[1]) if len(args) > 1 else 3
    flags = [a for a in sys.argv[1:] if a in ("--native", "--locals")]
    with stuck_job(mode, world) as (job_id, procs):
        if "--diagnose" in sys.argv[1:]:  # a live diagnosis of the job instead of recording
            print(json.dumps(diagnose(job_id)))
            return
        out = OUT / (mode + "".join("_" + f[2:] for f in flags))
        out.mkdir(parents=True, exist_ok=True)
        for r, p in enumerate(procs):
            dump = subprocess.run(["py-spy", "dump", "--pid", str(p.pid), *flags],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            (out / f"rank{r}.txt").write_text(dump.stdout)
            print(f"rank {r}: {len(dump.stdout)} chars {dump.stderr[:200]}", flush=True)
        print(f"recorded {world} ranks into {out}")


if __name__ == "__main__":
    main()
