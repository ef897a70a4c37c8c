"""Issue 23 and issue 22 (items 4, 5): `hangdx watch` reads cheap signals first and samples stacks only to confirm.

Real processes throughout: a hung zoo job (torch.distributed over gloo, every rank blocked), slow-but-alive jobs
(a rank computing, one reading a file, one writing a checkpoint), a rank evaluating while the other waits in
all_reduce, real py-spy, real /proc counters, and a real redis-server for what was raised and the kept bundle.
The watcher's clock is stepped by a pass interval while real time passes a second per pass: its decisions are
checked, never its timings (bench/watch.py measures those)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangdx.bot.diagnosis import DiagnoseOptions
from hangdx.bot.watch import (
    Ledger,
    RedisLedger,
    RunningJob,
    Watcher,
    WatchSettings,
    keep_bundle,
    load_bundle,
    read_counters,
)

from .test_incidents import needs_redis, redis_url  # noqa: F401  (the session's redis-server)

COMPUTE = (
    "import os, time\nos.nice(10)\ndef forward_backward():\n    x = 0\n    end = time.monotonic() + 300\n"
    "    while time.monotonic() < end:\n        x += 1\nforward_backward()\n"
)
READ = (
    "import os, time\ndef read_shard(path):\n    while True:\n        with open(path, 'rb') as f:\n"
    "            while f.read(65536):\n                time.sleep(0.05)\nread_shard({path!r})\n"
)
WRITE = (
    "import os, time\ndef save_checkpoint(path):\n    with open(path, 'wb') as f:\n        while True:\n"
    "            f.write(b'x' * 65536); f.flush(); time.sleep(0.1)\nsave_checkpoint({path!r})\n"
)
HUNG = "import time\ndef wait_for_allreduce():\n    time.sleep(600)\nwait_for_allreduce()\n"


def _spawn(job_id: str, code: str, rank: int = 0, world: int = 1, out=None, **extra: str) -> subprocess.Popen:  # noqa: ANN001
    env = {**os.environ, "HANGDX_JOB_ID": job_id, "RANK": str(rank), "WORLD_SIZE": str(world), **extra}
    env["LOCAL_RANK"] = str(rank)
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, stdout=out)


def _kill(procs) -> None:  # noqa: ANN001
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _passes(w: Watcher, clock: Clock, n: int, step: float = 15.0) -> list[dict[str, object]]:
    """n passes, the watcher's clock a pass interval on and real time a second on between them."""
    out = []
    for _ in range(n):
        out.append({d.job_id: d for d in w.check()})
        clock.t += step
        time.sleep(1.0)
    return out


def test_counters_name_each_rank_and_cost_milliseconds():
    stamp = f"ctr-{os.getpid()}"
    procs = [_spawn(stamp, HUNG, 0, 2), _spawn(stamp, COMPUTE, 1, 2)]
    try:
        time.sleep(1.5)
        first = read_counters(stamp, DiagnoseOptions(how="local"))
        time.sleep(1.5)
        second = read_counters(stamp, DiagnoseOptions(how="local"))
    finally:
        _kill(procs)
    assert first is not None and second is not None
    assert sorted(first.ranks) == [0, 1]
    assert first.cost_ms < 1000  # a /proc walk, no ptrace: milliseconds, not the seconds a py-spy probe takes
    from hangdx.bot.watch import moved_ranks

    moved = moved_ranks(first, second, 1.5)
    assert list(moved) == [1] and moved[1].startswith("computing"), moved
    assert read_counters("no-such-job-xyz", DiagnoseOptions(how="local")) is None


def test_a_flat_job_is_confirmed_and_computing_reading_writing_ranks_are_progress(tmp_path):
    stamp = str(os.getpid())
    data = tmp_path / "shard.bin"
    data.write_bytes(os.urandom(1 << 20))
    jobs = {
        f"hung-{stamp}": [(HUNG, 0, 2)],  # rank 1 never started: every live rank waits
        f"compute-{stamp}": [(COMPUTE, 0, 1)],
        f"read-{stamp}": [(READ.format(path=str(data)), 0, 1)],
        f"write-{stamp}": [(WRITE.format(path=str(tmp_path / "ckpt.bin")), 0, 1)],
    }
    procs = [_spawn(job, code, rank, world) for job, ranks in jobs.items() for code, rank, world in ranks]
    probed: list[str] = []
    opened = []
    clock = Clock()
    try:
        time.sleep(1.5)
        from hangdx.bot.watch import probe

        settings = WatchSettings("inventory:-", probe=DiagnoseOptions(how="local", samples=2, interval=1.0))

        def confirm(job_id: str):
            probed.append(job_id)
            return probe(job_id, settings.probe)

        w = Watcher(
            settings,
            opened.append,
            lambda: [RunningJob(j) for j in jobs],
            confirm,
            clock=clock,
            ledger=Ledger(),
        )
        passes = _passes(w, clock, 5)
    finally:
        _kill(procs)
    hung = f"hung-{stamp}"
    outcomes = {job: [p[job].outcome for p in passes] for job in jobs}
    # Flat from its first reading: probed once the window (30 s) has passed, confirmed, raised once.
    assert outcomes[hung] == ["quiet", "quiet", "stalled", "raised", "raised"], outcomes[hung]
    assert probed == [hung], (outcomes, probed)
    assert "age unknown" in passes[2][hung].reason and "every counter flat for 30s" in passes[2][hung].reason
    assert "every rank waiting with its stack unchanged" in passes[2][hung].reason
    (req,) = opened
    assert req.job_id == hung and not req.summary.startswith("hangdx watch")  # the timeline adds "watch: "
    for job, how in ((f"compute-{stamp}", "computing"), (f"read-{stamp}", "reading or writing"),
                     (f"write-{stamp}", "reading or writing")):  # fmt: skip
        assert outcomes[job][1:] == ["moving"] * 4, (job, outcomes[job])
        assert how in passes[2][job].reason, passes[2][job].reason


def test_a_zoo_hang_is_confirmed_from_flat_counters():
    pytest.importorskip("torch")
    from hangdx.zoo.launch import ZooJob

    clock = Clock()
    opened = []
    with ZooJob("io_hang") as job:
        job.wait_until_stuck(timeout=150)
        settings = WatchSettings("inventory:-", probe=DiagnoseOptions(how="local", samples=2, interval=1.0))
        w = Watcher(settings, opened.append, lambda: [RunningJob(job.job_id)], clock=clock)
        passes = _passes(w, clock, 4)
    outcomes = [p[job.job_id].outcome for p in passes]
    assert outcomes == ["quiet", "quiet", "stalled", "raised"], [p[job.job_id].reason for p in passes]
    assert len(opened) == 1 and "every rank waiting" in opened[0].summary


@needs_redis
def test_what_was_raised_lives_in_redis_and_a_second_watcher_does_not_raise_it_again(redis_url):  # noqa: F811
    from hangdx.bot.incidents import connect

    conn = connect(redis_url)
    conn.flushdb()
    job = f"twice-{os.getpid()}"
    procs = [_spawn(job, HUNG, 0, 2)]
    probes: list[str] = []
    try:
        time.sleep(1.5)
        from hangdx.bot.watch import probe

        def confirm(job_id: str):
            probes.append(job_id)
            return probe(job_id, DiagnoseOptions(how="local", samples=2, interval=1.0))

        first_opened, second_opened = [], []
        clock = Clock()
        s = WatchSettings("inventory:-")
        first = Watcher(
            s, first_opened.append, lambda: [RunningJob(job)], confirm, clock, ledger=RedisLedger(conn)
        )
        _passes(first, clock, 4)
        # A restarted (or second) watcher: nothing in its memory, the same Redis.
        second = Watcher(s, second_opened.append, lambda: [RunningJob(job)], confirm, clock,
                         ledger=RedisLedger(conn))  # fmt: skip
        again = _passes(second, clock, 4)
    finally:
        _kill(procs)
    assert len(first_opened) == 1 and second_opened == [] and probes == [job]
    assert {p[job].outcome for p in again} == {"raised"}


@needs_redis
def test_the_bundle_is_in_the_incident_after_the_job_is_killed_and_the_thread_says_it_died(
    redis_url,  # noqa: F811
    monkeypatch,
):
    from hangdx.bot import queue as hq
    from hangdx.bot.incidents import IncidentStore, connect

    conn = connect(redis_url)
    conn.flushdb()
    monkeypatch.setenv("REDIS_URL", redis_url)
    job = f"killed-{os.getpid()}"
    procs = [_spawn(job, HUNG, 0, 2)]
    listed = [RunningJob(job)]
    said: list[tuple[str, str]] = []
    opened = []
    store = IncidentStore(conn)

    def submit(req):  # noqa: ANN001 - as Service.submit does: open the incident, queue the diagnosis
        store.open_or_join(req)
        opened.append(req)

    clock = Clock()
    try:
        time.sleep(1.5)
        w = Watcher(
            WatchSettings("inventory:-", probe=DiagnoseOptions(how="local", samples=2, interval=1.0)),
            submit,
            lambda: listed,
            clock=clock,
            ledger=RedisLedger(conn),
            keep=lambda j, docs: keep_bundle(conn, j, docs),
            say=lambda j, text: said.append((j, text)),
        )
        _passes(w, clock, 4)
        assert len(opened) == 1, "the hung job was not raised"
    finally:
        _kill(procs)  # the watchdog: the job and its live evidence are gone before the diagnosis runs
    kept = load_bundle(conn, job)
    assert kept is not None and any(a["kind"] == "pyspy" for d in kept[1] for a in d["artifacts"])
    out = hq.run_diagnosis(opened[0].to_dict(), {"how": "local", "samples": 2, "interval": 0.5})
    assert out["error"] is None, out
    verdict = out["verdict"]
    assert verdict["root_cause"]["category"] == "rank_crashed" and verdict["root_cause"]["culprit"][
        "ranks"
    ] == [1]
    assert "diagnosed from the evidence hangdx watch took" in " ".join(verdict["notes"])
    inc = store.get(job)
    assert inc.latest_verdict["root_cause"]["culprit"]["ranks"] == [1]
    opened_event = inc.timeline[0]
    assert (
        opened_event["detail"].startswith("watch: no output file")
        and "hangdx watch:" not in opened_event["detail"]
    )
    assert "kept the bundle taken on confirmation" in opened_event["detail"]
    # The job left the listing: one line in its thread, once, whatever the passes after.
    listed.clear()
    decisions = [d for p in _passes(w, clock, 2) for d in p.values()]
    assert [d.outcome for d in decisions] == ["ended"]
    assert said == [(job, decisions[0].reason)] and "the verdict in this thread stands" in said[0][1]


@pytest.mark.zoo
@needs_redis
def test_a_real_hangs_full_bundle_outlives_the_job_and_its_verdict_names_the_culprit(redis_url, monkeypatch):  # noqa: F811
    """Issue 23 item 2 with a real torch.distributed hang (the zoo's skip_collective: rank 1 skipped an all_reduce),
    its ranks serving their live Flight Recorder through torch's control plane: what the watcher keeps on
    confirmation is the full bundle (every rank's stacks and Flight Recorder, process state, the host's kernel log
    and fabric state), and the worker's verdict from it, after the job was killed, names rank 1."""
    pytest.importorskip("torch")
    from hangdx.bot import queue as hq
    from hangdx.bot.incidents import IncidentStore, connect
    from hangdx.zoo.launch import ZooJob

    conn = connect(redis_url)
    conn.flushdb()
    monkeypatch.setenv("REDIS_URL", redis_url)
    store = IncidentStore(conn)
    opened = []

    def submit(req):  # noqa: ANN001 - as Service.submit does: open the incident, queue the diagnosis
        store.open_or_join(req)
        opened.append(req)

    clock = Clock()
    with ZooJob("skip_collective", control_plane=True) as job:
        job.wait_until_stuck(timeout=150)
        w = Watcher(
            WatchSettings("inventory:-", probe=DiagnoseOptions(how="local", samples=2, interval=1.0)),
            submit,
            lambda: [RunningJob(job.job_id)],
            clock=clock,
            ledger=RedisLedger(conn),
            keep=lambda j, docs: keep_bundle(conn, j, docs),
        )
        outcomes = [p[job.job_id].outcome for p in _passes(w, clock, 4)]
    # The job is gone (its ranks killed, as the watchdog would); the bundle is not.
    assert outcomes == ["quiet", "quiet", "stalled", "raised"], outcomes
    kept = load_bundle(conn, job.job_id)
    assert kept is not None
    arts = [a for d in kept[1] for a in d["artifacts"]]
    by_kind: dict[str, set] = {}
    for a in arts:
        by_kind.setdefault(a["kind"], set()).add(a["rank"])
    assert by_kind["pyspy"] == by_kind["flight_recorder"] == {0, 1, 2, 3}, sorted(by_kind)
    assert "procstate" in by_kind and "ip_link" in by_kind, sorted(by_kind)
    errors = [e for d in kept[1] for e in d.get("errors") or []]
    assert "kernel_log" in by_kind or any(e["source"] == "kernel log" for e in errors)  # read, or why not
    out = hq.run_diagnosis(opened[0].to_dict(), {"how": "local", "samples": 2, "interval": 0.5})
    assert out["error"] is None, out
    rc = out["verdict"]["root_cause"]
    assert rc["category"] == "conditional_collective" and rc["culprit"]["ranks"] == [1], rc
    assert store.get(job.job_id).latest_verdict["root_cause"]["culprit"]["ranks"] == [1]


EVAL = """
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["MASTER_PORT"],
                        rank=int(os.environ["RANK"]), world_size=2, timeout=timedelta(seconds=600))
def evaluate(seconds):
    x, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        x += 1
    return x
t = torch.ones(8)
dist.all_reduce(t)
print("ready", flush=True)
if dist.get_rank() == 0:
    evaluate(300)
dist.all_reduce(t)
"""


def test_one_warning_before_the_watchdog_names_the_rank_holding_the_others(tmp_path):
    pytest.importorskip("torch")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    job = f"eval-{os.getpid()}"
    extra = {"MASTER_PORT": port, "HANGDX_COLLECTIVE_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    logs = [open(tmp_path / f"rank{r}.log", "wb") for r in (0, 1)]
    procs = [_spawn(job, EVAL, r, 2, out=logs[r], **extra) for r in (0, 1)]
    said: list[tuple[str, str]] = []
    opened = []
    clock = Clock()
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not all(
            "ready" in (tmp_path / f"rank{r}.log").read_text() for r in (0, 1)
        ):
            time.sleep(0.5)
        time.sleep(3)  # rank 0 evaluating, rank 1 in its all_reduce
        w = Watcher(
            WatchSettings("inventory:-", probe=DiagnoseOptions(how="local", samples=2, interval=1.0)),
            opened.append,
            lambda: [RunningJob(job)],
            clock=clock,
            say=lambda j, text: said.append((j, text)),
        )
        passes = _passes(w, clock, 6)
    finally:
        _kill(procs)
        for f in logs:
            f.close()
    outcomes = [p[job].outcome for p in passes]
    assert opened == [] and outcomes.count("warned") == 1, [p[job].reason for p in passes]
    assert set(outcomes) <= {"moving", "warned", "quiet"}, outcomes
    (text,) = [t for _, t in said]
    assert "rank 0 has been in `evaluate()` (<string>:" in text and "rank(s) 1 wait in allreduce" in text, (
        text
    )
    assert "the watchdog kills the job at 60 s" in text


@needs_redis
def test_once_is_a_dry_run_says_unknown_and_names_no_other_job(redis_url, tmp_path):  # noqa: F811
    from hangdx.bot.incidents import IncidentStore, connect

    conn = connect(redis_url)
    conn.flushdb()
    stamp = str(os.getpid())
    hung, ghost, other = f"once-hung-{stamp}", f"once-ghost-{stamp}", f"someone-elses-{stamp}"
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(f"jobs:\n  {hung}: [localhost]\n  {ghost}: [localhost]\n")
    procs = [_spawn(hung, HUNG, 0, 2), _spawn(other, HUNG, 0, 1)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "HANGDX_"))}
    env["REDIS_URL"] = redis_url

    def once(*extra: str) -> dict[str, list[str]]:
        argv = ["watch", "--inventory", str(inventory), "--once", "--probe", "local", *extra]
        out = subprocess.run([sys.executable, "-m", "hangdx", *argv], env=env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return {ln.split("\t")[0]: ln.split("\t")[1:] for ln in out.stdout.splitlines()}

    try:
        time.sleep(1.5)
        dry = once()
        store = IncidentStore(connect(redis_url))
        after_dry = store.get(hung)
        raised = once("--raise")
        again = once("--raise")
    finally:
        _kill(procs)
    assert dry[hung][0] == "stalled" and "dry run: not raised" in dry[hung][1], dry
    assert "age unknown" in dry[hung][1] and "600s since" not in dry[hung][1]
    assert after_dry is None
    assert dry[ghost][0] == "unconfirmed" and other not in dry[ghost][1], dry[ghost]
    assert raised[hung][0] == "stalled" and store.get(hung) is not None
    assert again[hung] == ["raised", "its incident is open"]
    assert len([e for e in store.get(hung).timeline if e.get("actor") == "hangdx watch"]) == 1


@needs_redis
def test_a_job_whose_incident_an_alert_opened_is_not_raised_again_until_it_is_resolved(redis_url, tmp_path):  # noqa: F811
    """Issue 22 item 4: `watch --once --raise` (or a running watcher) never queues a second diagnosis of a job whose
    incident is open, whoever opened it; once that incident is resolved, a job still hung is raised afresh."""
    from hangdx.bot.incidents import IncidentStore, connect
    from hangdx.bot.request import DiagnoseRequest

    conn = connect(redis_url)
    conn.flushdb()
    job = f"alerted-{os.getpid()}"
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(f"jobs:\n  {job}: [localhost]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "HANGDX_"))}
    env["REDIS_URL"] = redis_url
    store = IncidentStore(conn)
    store.open_or_join(
        DiagnoseRequest(job, "alert", "alertmanager", summary="no training progress for 20m 0s")
    )
    procs = [_spawn(job, HUNG, 0, 2)]

    def once() -> list[str]:
        argv = ["watch", "--inventory", str(inventory), "--once", "--raise", "--probe", "local"]
        out = subprocess.run([sys.executable, "-m", "hangdx", *argv], env=env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return next(ln.split("\t")[1:] for ln in out.stdout.splitlines() if ln.startswith(job + "\t"))

    try:
        time.sleep(1.5)
        left = once()
        timeline = [(e["actor"], e["event"]) for e in store.get(job).timeline]
        runs = dict(store.runs())
        store.set_status(job, "resolved", "U0ONCALL01", "thought fixed")
        raised = once()
    finally:
        _kill(procs)
    assert left == ["raised", "its incident is open (not raised by hangdx watch): left to it"], left
    assert timeline == [("alertmanager", "opened")] and job not in runs, (timeline, runs)
    assert raised[0] == "stalled", raised
    inc = store.get(job)
    assert inc.is_open and [e["actor"] for e in inc.timeline if e["event"] == "opened"] == ["hangdx watch"]


def test_raise_without_once_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "hangdx", "watch", "--inventory", "x.yaml", "--raise"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "--raise goes with --once" in out.stderr


def test_the_counters_script_runs_as_the_nodes_run_it(tmp_path):
    """What SSH sends a node (`python3 -` reading the collector with a --counters trailer) prints the document."""
    from hangdx.bot.watch import counters_script, reading_of

    job = f"script-{os.getpid()}"
    procs = [_spawn(job, HUNG, 0, 1)]
    try:
        time.sleep(1.0)
        out = subprocess.run(["python3", "-"], input=counters_script(job, "node-a"), capture_output=True,
                             timeout=60)  # fmt: skip
    finally:
        _kill(procs)
    import json

    doc = json.loads(out.stdout)
    reading = reading_of([doc])
    assert doc["host"] == "node-a" and reading is not None and list(reading.ranks) == [0]
    assert Path("/proc").exists()


def test_a_gpu_spinning_in_a_hung_collective_is_flat_and_one_whose_work_changes_is_not():
    """GPU readings in the collector's form (hand-written values, no GPU here: a kernel spinning in a hung
    all-reduce holds 100% and a steady power draw; a change of work swings utilisation and power)."""
    from hangdx.bot.watch import Reading, gpus_moved

    def reading(util: int, power: float) -> Reading:
        return Reading({("n1", 1): {"pid": 1, "rank": 0}}, {("n1", "GPU-1"): (util, power)})

    assert gpus_moved(reading(100, 151.2), reading(100, 152.0)) == []
    assert gpus_moved(reading(100, 151.2), reading(63, 402.5)) == ["GPU GPU-1 on n1"]


@needs_redis
def test_redis_down_is_one_line_for_the_pass_not_a_traceback():
    import redis

    from hangdx.bot.watch import WatchError

    ledger = RedisLedger(redis.Redis.from_url("redis://127.0.0.1:9/0", socket_connect_timeout=1))
    w = Watcher(WatchSettings("inventory:-"), lambda r: "", lambda: [RunningJob("j1")], ledger=ledger,
                counters=lambda j: None)  # fmt: skip
    with pytest.raises(WatchError, match="^Redis, where what was raised is kept: "):
        w.check()


def test_collective_counts_from_another_source_are_progress():
    """Where a counters document carries per-rank collective counts (NCCL RAS's, read by its own reader), a
    count that grows is progress even when the rank's /proc counters are flat (a GPU rank's CPU thread idles)."""
    from hangdx.bot.watch import moved_ranks, reading_of

    row = {"pid": 7, "rank": 0, "cpu_ms": 10, "main_cpu_ms": 5, "main_switches": 3, "io_bytes": 100}
    doc = {"hangdx": "counters", "host": "n1", "processes": [row], "collective_counts": {"0": 41}}
    before, after = reading_of([doc]), reading_of([{**doc, "collective_counts": {"0": 44}}])
    assert moved_ranks(before, after, 15.0) == {0: "completed 3 collective(s)"}
    assert moved_ranks(before, reading_of([doc]), 15.0) == {}


def test_the_collective_timeout_is_read_from_the_ranks_environment():
    stamp = f"tmo-{os.getpid()}"
    procs = [
        _spawn(f"{stamp}-ds", HUNG, 0, 1, DEEPSPEED_TIMEOUT="3"),  # DeepSpeed's, in minutes
        _spawn(f"{stamp}-own", HUNG, 0, 1, HANGDX_COLLECTIVE_TIMEOUT="90", DEEPSPEED_TIMEOUT="3"),
        _spawn(f"{stamp}-none", HUNG, 0, 1),
    ]
    try:
        time.sleep(1.0)
        got = {k: read_counters(f"{stamp}-{k}", DiagnoseOptions(how="local")) for k in ("ds", "own", "none")}
    finally:
        _kill(procs)
    assert {k: r.timeout for k, r in got.items()} == {"ds": 180.0, "own": 90.0, "none": None}


# `ncclras` as NCCL >= 2.28.7 answers `-f json` (tests/fixtures/ncclras/gen_lagging_2.29.7.json, made with the C
# format strings of NCCL's src/ras/client_support.cc): the ranks given in `pids` are this test's processes, and each
# query adds `step` AllReduce operations to every rank's count, as a job advancing between two passes would.
RAS_STANDIN = """#!{python}
import json, sys
with open({log!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
calls = sum(1 for _ in open({log!r}))
with open({fixture!r}) as f:
    doc = json.load(f)
for comm in doc["communicators"]:
    for r in comm["ranks"]:
        r["pid"] = {pids!r}.get(r["rank"], r["pid"])
        r["collective_counts"]["AllReduce"] += calls * {step}
json.dump(doc, sys.stdout, indent=2)
"""


def _ras_on_path(tmp_path: Path, monkeypatch, pids: dict[int, int], step: int) -> Path:  # noqa: ANN001
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "ncclras" / "gen_lagging_2.29.7.json"
    bindir, log = tmp_path / "bin", tmp_path / "ncclras-argv.log"
    bindir.mkdir()
    script = bindir / "ncclras"
    script.write_text(RAS_STANDIN.format(python=sys.executable, log=str(log), fixture=str(fixture), pids=pids,
                                         step=step))  # fmt: skip
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return log


@pytest.mark.parametrize(
    "case, step, ours",
    [
        # The job's collectives advance: progress, though every rank's CPU thread is idle.
        ("growing", 1, True),
        ("stuck", 0, True),  # RAS answers with the same counts: the job is flat, its stacks confirm the hang
        ("another job's", 1, False),  # RAS on the port names none of this job's pids: its counts are not ours
    ],
)
def test_nccl_ras_collective_counts_are_a_cheap_signal(tmp_path, monkeypatch, case, step, ours):
    """Issue 23 item 1: NCCL RAS (`ncclras`, where it is on the node) as one of the watcher's cheap signals. The
    ranks are real processes asleep (their /proc counters flat); what RAS says of them decides."""
    job = f"ras-{case.split()[0].strip(chr(39))}-{os.getpid()}"
    procs = [_spawn(job, HUNG, r, 8) for r in (0, 1)]
    probed: list[str] = []
    clock = Clock()
    try:
        time.sleep(1.5)
        pids = {p_rank: p.pid + (10**6 if not ours else 0) for p_rank, p in enumerate(procs)}
        log = _ras_on_path(tmp_path, monkeypatch, pids, step)
        from hangdx.bot.watch import probe

        opts = DiagnoseOptions(how="local", samples=2, interval=1.0)

        def confirm(job_id: str):
            probed.append(job_id)
            return probe(job_id, opts)

        first = read_counters(job, opts)
        w = Watcher(WatchSettings("inventory:-", probe=opts), lambda r: "", lambda: [RunningJob(job)], confirm,
                    clock=clock)  # fmt: skip
        passes = _passes(w, clock, 4)
    finally:
        _kill(procs)
    outcomes = [p[job].outcome for p in passes]
    assert log.read_text().splitlines()[0] == "-t 2 -f json"  # the fixed argv, on rank 0's node
    if case == "growing":
        # Every query adds one AllReduce to each of the 8 ranks (those on other nodes included: one query sees all).
        assert first is not None and sorted(first.collectives) == list(range(8)), first
        assert outcomes[1:] == ["moving"] * 3 and probed == [], [p[job].reason for p in passes]
        assert "rank 0 completed 1 collective(s)" in passes[1][job].reason
    else:
        assert probed == [job] and outcomes[2] == "stalled", [p[job].reason for p in passes]
        assert (first.collectives != {}) is ours, first.collectives
