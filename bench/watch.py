"""`hangdx watch` soak: detection latency and false alarms of the DEFAULT settings, over real jobs.

    nice -n 10 python bench/watch.py [--minutes 30] [--hung-slots 2]

Runs `hangdx watch --inventory FILE` (its defaults: a pass every 15 s, stacks sampled once every signal was flat
for 30 s) and `hangdx worker` as processes against a throwaway redis-server and the local Slack Web API stand-in,
with HANGDX_RESOLVER=local. The jobs are real torch.distributed programs (gloo on 127.0.0.1, two ranks each, one
process per rank), listed in the inventory while they run:

- slow but alive, for the whole soak: `slow_step` (45 s silent steps), `checkpoint` (rank 0 writes a checkpoint for
  2 minutes while rank 1 waits in a barrier), `eval` (rank 0 evaluates for 5 minutes while rank 1 waits in
  all_reduce; its ranks' HANGDX_COLLECTIVE_TIMEOUT is 480 s, so the watcher warns once before the watchdog),
  `loader` (a DataLoader whose workers warm up for 90 s before the first batch, every epoch);
- hung: jobs that step normally and, at a random time, hang: rank 1 blocks opening a file nobody writes (a hung
  mount) or deadlocks on its own lock, while rank 0 waits in all_reduce. Once its verdict is posted, the job is
  killed (as the NCCL watchdog would) and another starts in its slot.

Printed: per hang, seconds from the hang to its thread (the parent post) and to the verdict; the median and max;
false alarms (a thread for a slow job, or for a hung job before it hung); warnings; "job ended" lines; and the
collector's cost per pass on the node (the counters read, in milliseconds).

Computing is duty-cycled (20% of a core per busy rank) so that the soak can run on a small shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

SLOW_KINDS = ("slow_step", "checkpoint", "eval", "loader")
CHANNEL = "C0ALERTS01"


# ---------------------------------------------------------------- one rank of a soak job (run as a process)


def busy(seconds: float) -> int:
    """Compute for `seconds`, 20% of a core: 40 ms bursts."""
    end, x = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        burst = time.monotonic() + 0.04
        while time.monotonic() < burst:
            x += 1
        time.sleep(0.16)
    return x


def evaluate(seconds: float) -> int:
    return busy(seconds)


def write_checkpoint(path: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    with open(path, "wb") as f:
        while time.monotonic() < end:
            f.write(os.urandom(256 * 1024))
            f.flush()
            os.fsync(f.fileno())
            time.sleep(0.5)


def load_shard(path: str) -> bytes:
    with open(path, "rb") as f:  # a FIFO nobody writes: blocks in open(), as on a hung mount
        return f.read()


def rank_main(kind: str, workdir: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=2,
        timeout=timedelta(hours=2),
    )
    t = torch.ones(1024)
    hang_at = time.time() + float(os.environ.get("SOAK_HANG_AFTER", "1e9"))
    how = os.environ.get("SOAK_HANG_HOW", "fifo")
    step = 0
    while True:
        step += 1
        if kind == "hung" and rank == 1 and time.time() >= hang_at:
            Path(workdir, "hung_at").write_text(repr(time.time()))
            if how == "fifo":
                fifo = os.path.join(workdir, "shard.fifo")
                os.mkfifo(fifo)
                load_shard(fifo)
            else:
                import threading

                lock = threading.Lock()
                lock.acquire()
                lock.acquire()  # its own lock, taken twice: a user deadlock
        if kind == "slow_step":
            busy(45)
        elif kind == "eval" and step % 4 == 0:
            if rank == 0:
                evaluate(300)
        elif kind == "checkpoint" and step % 30 == 0:
            if rank == 0:
                write_checkpoint(os.path.join(workdir, "ckpt.bin"), 120)
            dist.barrier()
        elif kind == "loader" and step % 60 == 1:

            class Warm(torch.utils.data.Dataset):
                def __len__(self) -> int:
                    return 4

                def __getitem__(self, i: int):
                    busy(45)  # decoding, shuffling buffers: 90 s before the first batch with two workers
                    return torch.ones(4)

            loader = torch.utils.data.DataLoader(Warm(), batch_size=2, num_workers=2)
            for batch in loader:
                t[:4] += batch.sum()
        else:
            busy(0.5)
            time.sleep(1.0)
        dist.all_reduce(t)
        print(f"step {step}", flush=True)


# ---------------------------------------------------------------- the soak


class Job:
    def __init__(self, kind: str, root: str, n: int, hang_after: float | None = None) -> None:
        import socket

        self.kind, self.n = kind, n
        self.job_id = f"soak-{kind}-{n}-{os.getpid()}"
        self.workdir = tempfile.mkdtemp(prefix=f"{kind}-", dir=root)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "HANGDX_JOB_ID": self.job_id,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "SOAK_HANG_AFTER": str(hang_after if hang_after is not None else 1e9),
                "SOAK_HANG_HOW": random.choice(("fifo", "lock")),
            }
            if kind == "eval":
                env["HANGDX_COLLECTIVE_TIMEOUT"] = "480"
            log = open(os.path.join(self.workdir, f"rank{rank}.log"), "wb")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank", kind, self.workdir],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            log.close()
        self.started = time.time()

    @property
    def hung_at(self) -> float | None:
        try:
            return float(Path(self.workdir, "hung_at").read_text())
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def write_inventory(path: str, jobs: list[Job]) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(
        "jobs:\n" + "".join(f"  {j.job_id}: [localhost]\n" for j in jobs) if jobs else "jobs: {}\n"
    )
    os.replace(tmp, path)


def soak(minutes: float, hung_slots: int, seed: int) -> dict:
    from slack_standin import SlackStandin

    from hangdx.probes import collector
    from tests.bot.test_incidents import start_redis, stop_redis

    random.seed(seed)
    root = tempfile.mkdtemp(prefix="hangdx-soak-")
    inventory = os.path.join(root, "inventory.yaml")
    redis_proc, redis_url = start_redis(root)
    slow = [Job(kind, root, i) for i, kind in enumerate(SLOW_KINDS)]
    hung: list[Job | None] = [None] * hung_slots
    done: list[dict] = []
    n = 100
    t_end = time.time() + minutes * 60
    counter_ms: list[float] = []
    procs: list[subprocess.Popen] = []
    try:
        with SlackStandin() as slack:
            env = {
                **os.environ,
                "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxsoak",
                "SLACK_API_URL": slack.url,
                "REDIS_URL": redis_url,
                "HANGDX_ALERT_CHANNEL": CHANNEL,
                "HANGDX_RESOLVER": "local",
            }
            env.pop("SLACK_APP_TOKEN", None)
            for i in range(hung_slots):
                hung[i] = Job("hung", root, n, random.uniform(60, 300))
                n += 1
            write_inventory(inventory, slow + [j for j in hung if j])
            wlog = open(os.path.join(root, "worker.log"), "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "hangdx", "worker"], env=env, stdout=wlog, stderr=wlog
                )
            )
            watch_log = os.path.join(root, "watch.log")
            with open(watch_log, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "hangdx", "watch", "--inventory", inventory], env=env, stderr=f
                    )
                )
            first_seen: dict[tuple[str, bool], float] = {}
            last_cost = 0.0
            while time.time() < t_end:
                now = time.time()
                for c in slack.calls_to("chat.postMessage"):
                    text = json.dumps(c.body)
                    if "the watchdog kills the job" in text:
                        continue  # a warning before the watchdog, not an incident's thread
                    for j in slow + [j for j in hung if j] + [d["job"] for d in done]:
                        if j.job_id in text:
                            first_seen.setdefault((j.job_id, bool(c.body.get("thread_ts"))), now)
                    if "since hangdx watch confirmed" in text:
                        first_seen.setdefault(("ended:" + text[:200], True), now)
                for i, j in enumerate(hung):
                    if j is None:
                        continue
                    verdict = any(
                        c.body.get("thread_ts") and c.body.get("blocks") and j.job_id in json.dumps(c.body)
                        for c in slack.calls_to("chat.postMessage")
                    )
                    if verdict or now - j.started > 900:
                        j.kill()  # the watchdog's SIGKILL: the verdict must stand on the kept bundle
                        done.append(
                            {"job": j, "parent": first_seen.get((j.job_id, False)), "verdict_at": now}
                        )
                        hung[i] = None
                        if now < t_end - 240:
                            hung[i] = Job("hung", root, n, random.uniform(30, 240))
                            n += 1
                        write_inventory(inventory, slow + [h for h in hung if h])
                if now - last_cost > 60:
                    last_cost = now
                    for j in slow:
                        counter_ms.append(collector.counters(j.job_id)["elapsed_ms"])
                time.sleep(0.5)
            ended_lines = sum(1 for k in first_seen if k[0].startswith("ended:"))
            warnings = [
                c.body.get("text", "")
                for c in slack.calls_to("chat.postMessage")
                if "the watchdog kills" in json.dumps(c.body)
            ]
            parents = [c.body for c in slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]
            from hangdx.bot.incidents import IncidentStore, connect

            store = IncidentStore(connect(redis_url))
            incidents_of_slow = [j.job_id for j in slow if store.get(j.job_id) is not None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for j in slow + [h for h in hung if h]:
            j.kill()
        stop_redis(redis_proc)
    latencies, to_verdict, false_alarms = [], [], []
    for j in slow:
        if (j.job_id, False) in first_seen or j.job_id in incidents_of_slow:
            false_alarms.append(j.job_id)
    for d in done:
        j, parent = d["job"], d["parent"]
        hung_at = j.hung_at
        if parent is not None and (hung_at is None or parent < hung_at):
            false_alarms.append(j.job_id)
        elif parent is not None:
            latencies.append(parent - hung_at)
            to_verdict.append(d["verdict_at"] - hung_at)
    missed = [d["job"].job_id for d in done if d["job"].hung_at is not None and d["parent"] is None]
    return {
        "minutes": minutes,
        "hangs": len([d for d in done if d["job"].hung_at is not None]),
        "latencies": latencies,
        "to_verdict": to_verdict,
        "false_alarms": false_alarms,
        "missed": missed,
        "warnings": [w for w in warnings if "soak-eval" in w] or warnings,
        "ended_lines": ended_lines,
        "parents": len(parents),
        "counter_ms": counter_ms,
        "root": root,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--minutes", type=float, default=30.0, help="length of the soak (default 30, as issue 23)"
    )
    ap.add_argument("--hung-slots", type=int, default=2, help="hung jobs at a time (default 2)")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--rank", nargs=2, metavar=("KIND", "WORKDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(*args.rank)
        return 0
    r = soak(args.minutes, args.hung_slots, args.seed)
    lat, ver = sorted(r["latencies"]), sorted(r["to_verdict"])
    print(
        f"hangdx watch soak, default settings (a pass every 15 s, confirmation window 30 s): {r['minutes']:g} min"
    )
    print(f"jobs slow but alive: {', '.join(SLOW_KINDS)}; hangs: {r['hangs']} (missed: {len(r['missed'])})")
    if lat:
        print(f"{'':<26}{'median':>8}{'max':>8}")
        print(f"{'hang -> thread (s)':<26}{statistics.median(lat):>8.1f}{max(lat):>8.1f}")
        print(f"{'hang -> verdict seen (s)':<26}{statistics.median(ver):>8.1f}{max(ver):>8.1f}")
    print(f"false alarms: {len(r['false_alarms'])} {r['false_alarms']}")
    print(
        f"warnings before the watchdog: {len(r['warnings'])}"
        + (f" ({r['warnings'][0][:160]})" if r["warnings"] else "")
    )
    print(f"'job ended' lines in threads after the kill: {r['ended_lines']} of {len(lat)}")
    if r["counter_ms"]:
        cm = sorted(r["counter_ms"])
        print(
            f"counters read on the node, per job per pass: median {statistics.median(cm):.1f} ms, max {cm[-1]:.1f} ms"
        )
    print(f"(logs: {r['root']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
