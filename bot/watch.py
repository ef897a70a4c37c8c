"""`hangdx watch`: notice stalled jobs with nothing installed in them, and open an incident for each.

Every interval (15 s): list the running jobs (Slurm's `squeue --json`, or `scontrol show job` where Slurm is older
than 21.08; or an inventory's jobs), and for each watched job read what costs milliseconds and touches nothing in
the job: whether its stdout/stderr files grew, and each rank's counters from /proc on its nodes (the collector's
`--counters`: CPU time, the main thread's context switches, I/O bytes) and the GPUs' utilisation and power where
NVML is. A rank computing, reading or writing is progress. A job whose every signal stayed flat for the
confirmation window (30 s) gets one probe of its stacks (every rank sampled twice by the diagnosis's collector):
it is stalled when every rank is waiting (in a collective, asleep, blocked) and no stack moved. The probe's
documents are the full bundle, kept with the incident (Redis) so that its verdict stands when the watchdog kills
the job; the incident opens through the same Service.submit an alert reaches. What was raised lives in Redis: a
restarted or second watcher never raises a job twice. Ranks that wait in a collective for half the collective
timeout while another rank works get one warning before the watchdog kills the job.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError, check_job_id, collect
from hangdx.bot.request import DiagnoseRequest
from hangdx.playbooks.facts import Facts, derive
from hangdx.probes.local import JobNotFound, evidence_for_job

log = logging.getLogger("hangdx.watch")
OPT_OUT = "hangdx:off"  # in a job's comment (sbatch --comment): never watched
REQUESTED_BY = "hangdx watch"
# A key of `scontrol --oneliner show job` output: a value runs until the next " Key=" (paths may hold spaces).
_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")
_USER_ID = re.compile(r"(.*)\((\d+)\)")

Submit = Callable[[DiagnoseRequest], str]
Confirm = Callable[[str], "Confirmation"]


STORM_JOBS = 5  # this many jobs going quiet together are one incident (a shared file system, the fabric)
STORM_WINDOW = 300.0  # seconds within which they went quiet
STORM_PROBES = 3  # jobs of a storm probed before giving up on it for this pass
PROBES_PER_PASS = 5  # confirmation probes one pass runs (each takes seconds); the rest wait for the next


def _mount_of(path: str) -> str | None:
    """The mount point a file lives on (walking up to a mount, without following links)."""
    p = os.path.dirname(os.path.abspath(path))
    try:
        while not os.path.ismount(p) and p != os.path.dirname(p):
            p = os.path.dirname(p)
    except OSError:
        return None
    return p


def shared_causes(jobs: list[RunningJob]) -> str:
    """What a storm's jobs have in common that could stall them all: the file system their outputs are on,
    their partition, their user."""
    said = []
    mounts = {_mount_of(o) for j in jobs for o in j.outputs[:2]} - {None}
    if len(mounts) == 1 and all(j.outputs for j in jobs):
        said.append(f"the file system at {mounts.pop()} (their output files: a hung shared mount stalls every job "
                    "writing to it)")  # fmt: skip
    parts = {j.partition for j in jobs}
    if len(parts) == 1 and "" not in parts:
        said.append(f"partition {parts.pop()} (its nodes' fabric or storage)")
    users = {j.user for j in jobs}
    if len(users) == 1 and "" not in users:
        said.append(f"user {users.pop()}")
    return "; ".join(said)


class WatchError(Exception):
    """The jobs cannot be listed (scontrol missing or failing, a bad inventory): one line."""


@dataclass
class RunningJob:
    job_id: str
    user: str = ""
    uid: int | None = None
    partition: str = ""
    comment: str = ""
    outputs: list[str] = field(default_factory=list)  # its stdout/stderr files, as Slurm names them
    started: float | None = None  # when it started running (Slurm's StartTime), epoch seconds


@dataclass
class Confirmation:
    stalled: bool | None  # None: the probe could not tell (no rank found, one sample only)
    reason: str
    seconds: float = 0.0
    docs: list[dict] = field(default_factory=list)  # the collector's documents: the bundle to keep
    facts: Facts | None = None


@dataclass
class Decision:
    """What one pass concluded about one job."""

    job_id: str
    outcome: str  # skipped | moving | quiet | stalled | raised | unconfirmed | failed | deferred | grouped
    # | warned | ended
    reason: str = ""
    probe_seconds: float | None = None  # how long the confirmation probe took, when one ran


@dataclass
class WatchSettings:
    source: str  # "slurm" or "inventory:PATH"
    interval: float = 15.0  # seconds between passes (the cheap signals)
    stall: float = 30.0  # the confirmation window: every signal flat this long, the stacks are sampled
    quiet: float = 600.0  # outputs silent this long: sampled even while a counter ticks (a polling loop)
    collective_timeout: float = (
        600.0  # NCCL's process-group default; a rank's HANGDX_COLLECTIVE_TIMEOUT or DEEPSPEED_TIMEOUT wins
    )
    dry_run: bool = False  # judge and say, raise nothing (`--once` without --raise)
    once: bool = False  # one pass (`--once`): no earlier reading to compare counters with
    partitions: frozenset[str] = frozenset()  # empty: every partition
    users: frozenset[str] = frozenset()  # empty: every user
    jobs: frozenset[str] = frozenset()  # empty: every job
    exclude: frozenset[str] = frozenset()
    probe: DiagnoseOptions = field(default_factory=lambda: DiagnoseOptions(samples=2, interval=1.0))
    channel: str | None = None  # where incidents open; None: HANGDX_ALERT_CHANNEL


# ---------------------------------------------------------------- listing the running jobs


def scontrol_fields(record: str) -> dict[str, str]:
    """One job record of `scontrol --oneliner show job` as {key: value}."""
    keys = list(_SCONTROL_KEY.finditer(record))
    out: dict[str, str] = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(record)
        out.setdefault(m.group(1), record[m.end() : end].strip())
    return out


# The keys hangdx reads. Each is once in a record scontrol writes; twice means someone's text (a job name, a
# comment, a path) holds ` Key=...`, and no reading of such a record can tell which is Slurm's.
_READ_KEYS = (
    "JobId",
    "JobName",
    "UserId",
    "Partition",
    "JobState",
    "StartTime",
    "Comment",
    "StdErr",
    "StdOut",
)


def _scontrol_records(text: str) -> Iterator[str]:
    """Whole records of `scontrol --oneliner show job`: a line that does not start a record, or that starts one
    before the record in hand reached its StdOut (a newline in a job name or a comment), continues it."""
    record: list[str] = []
    for line in text.splitlines():
        done = record and _SCONTROL_KEY_AT("StdOut", " ".join(record))
        if line.startswith("JobId=") and (not record or done):
            if record:
                yield "\n".join(record)
            record = [line]
        elif record:
            record.append(line)
    if record:
        yield "\n".join(record)


def _SCONTROL_KEY_AT(key: str, record: str) -> bool:  # noqa: N802 - reads as the key test it is
    return re.search(r"(?:^|\s)" + key + "=", record) is not None


def parse_scontrol_jobs(text: str) -> list[RunningJob]:
    """The RUNNING jobs of `scontrol --oneliner show job` output (Slurm before 21.08, which has no --json). A
    record whose own text repeats a key hangdx reads is skipped, and said: it cannot be read safely."""
    jobs = []
    for record in _scontrol_records(text):
        keys = [m.group(1) for m in _SCONTROL_KEY.finditer(record)]
        twice = sorted({k for k in _READ_KEYS if keys.count(k) > 1})
        f = scontrol_fields(record)
        if twice:
            log.warning(
                "hangdx watch: job %r not watched: its scontrol record holds %s more than once (a job name, "
                "comment or path with ' Key=' in it)",
                f.get("JobId", "?")[:20],
                ", ".join(twice),
            )
            continue
        if f.get("JobState") != "RUNNING" or not f.get("JobId"):
            continue
        user, uid = f.get("UserId", ""), None
        m = _USER_ID.fullmatch(user)
        if m:
            user, uid = m.group(1), int(m.group(2))
        outputs = [f[k] for k in ("StdOut", "StdErr") if f.get(k, "").startswith("/")]
        jobs.append(
            RunningJob(
                job_id=f["JobId"],
                user=user,
                uid=uid,
                partition=f.get("Partition", ""),
                comment=f.get("Comment", "") if f.get("Comment") != "(null)" else "",
                outputs=list(dict.fromkeys(outputs)),
                started=_start_time(f.get("StartTime", "")),
            )
        )
    return jobs


# sbatch's filename patterns (man sbatch, "filename pattern"): %j job id, %u user, %x job name, %A/%a array
# job and task, %N the first node, %n/%t 0 for the batch step, %s its step, %% a percent; a width pads numbers.
_FILENAME_PATTERN = re.compile(r"%(\d{0,2})([%AaJjNnstux])")


def _number(value: object) -> int | None:
    """A JSON number as squeue writes it: a plain int (v0.0.38) or {"set": true, "number": N} (later)."""
    if isinstance(value, dict):
        if value.get("infinite") or value.get("set") is False:
            return None
        value = value.get("number")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _output_path(path: str, job: dict, job_id: str, user: str) -> str:
    """Slurm's own path for a job's stdout or stderr, its filename pattern filled in as Slurm fills it."""
    if "\\" in path:
        return path.replace("\\", "")  # a backslash turns the patterns off
    array_job, array_task = _number(job.get("array_job_id")), _number(job.get("array_task_id"))
    nodes = _text(job.get("batch_host")) or _text(job.get("nodes")).split(",")[0]
    values = {
        "%": "%", "j": job_id, "J": f"{job_id}.batch", "u": user, "x": _text(job.get("name")),
        "A": str(array_job or job_id), "a": str(array_task if array_task is not None else 4294967294),
        "N": nodes, "n": "0", "t": "0", "s": "batch",
    }  # fmt: skip

    def fill(m: re.Match) -> str:
        value = values[m.group(2)]
        return value.zfill(int(m.group(1))) if m.group(1) and value.isdigit() else value

    path = _FILENAME_PATTERN.sub(fill, path)
    cwd = _text(job.get("current_working_directory"))
    return path if path.startswith("/") or not cwd else os.path.join(cwd, path)


def parse_squeue_json(text: str) -> list[RunningJob]:
    """The RUNNING jobs of `squeue --json` (Slurm 21.08 and later): each field is its own JSON value, so no job's
    name, comment or path can stand in for another field or another job."""
    doc = json.loads(text)
    jobs = []
    for j in doc.get("jobs") or [] if isinstance(doc, dict) else []:
        if not isinstance(j, dict):
            continue
        state = j.get("job_state")
        if not (state == "RUNNING" or (isinstance(state, list) and "RUNNING" in state)):
            continue
        number = _number(j.get("job_id"))
        if number is None:
            continue
        job_id, user = str(number), _text(j.get("user_name"))
        array = _number(j.get("array_task_id")) is not None
        stdout = _text(j.get("standard_output")) or ("slurm-%A_%a.out" if array else "slurm-%j.out")
        stderr = _text(j.get("standard_error")) or stdout
        outputs = [_output_path(p, j, job_id, user) for p in (stdout, stderr)]
        started = _number(j.get("start_time"))
        comment = _text(j.get("comment"))
        jobs.append(
            RunningJob(
                job_id=job_id,
                user=user,
                uid=_number(j.get("user_id")),
                partition=_text(j.get("partition")),
                comment="" if comment == "(null)" else comment,
                outputs=list(dict.fromkeys(p for p in outputs if p.startswith("/"))),
                started=float(started) if started else None,
            )
        )
    return jobs


def _start_time(value: str) -> float | None:
    """Slurm's StartTime (`2026-11-24T20:30:01`, the controller's local time) as epoch seconds."""
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _run_listing(cmd: list[str], what: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired:
        raise WatchError(f"{what} did not answer within {timeout:g}s") from None
    except OSError as e:
        raise WatchError(f"{what} could not run: {e}") from None


def _first_line(out: subprocess.CompletedProcess) -> str:
    err = out.stderr.decode("utf-8", "replace").strip()
    return next((ln.strip() for ln in err.splitlines() if ln.strip()), f"exit status {out.returncode}")


def list_slurm_jobs(
    scontrol: str = "scontrol", timeout: float = 20.0, squeue: str = "squeue"
) -> list[RunningJob]:
    """Every running job Slurm knows, in one RPC whatever the count: `squeue --json`, whose fields no job's text
    can shadow; `scontrol --oneliner show job` where squeue has no --json (Slurm before 21.08)."""
    exe = shutil.which(squeue)
    if exe is not None:
        out = _run_listing([exe, "--json"], "squeue --json", timeout)
        if out.returncode == 0:
            try:
                return parse_squeue_json(out.stdout.decode("utf-8", "replace"))
            except (ValueError, TypeError, AttributeError) as e:
                raise WatchError(f"squeue --json printed what is not its JSON: {e}") from None
        first = _first_line(out)
        if "option" not in first:  # anything but "unrecognized option '--json'" is Slurm's answer
            raise WatchError(f"squeue --json failed: {first}")
    exe = shutil.which(scontrol)
    if exe is None:
        raise WatchError(
            f"{scontrol} not found: run hangdx watch --slurm where Slurm's commands are installed"
        )
    out = _run_listing([exe, "--oneliner", "show", "job"], "scontrol show job", timeout)
    text = out.stdout.decode("utf-8", "replace")
    if out.returncode != 0:
        err = out.stderr.decode("utf-8", "replace").strip()
        if "No jobs in the system" in err or "No jobs in the system" in text:
            return []
        raise WatchError(f"scontrol show job failed: {_first_line(out)}")
    return parse_scontrol_jobs(text)


def list_inventory_jobs(path: str) -> list[RunningJob]:
    """An inventory's jobs, all taken as running: with no output files known, each is probed every stall window."""
    from hangdx.probes import resolve
    from hangdx.probes.hosts import HostError

    try:
        resolve.from_inventory(path, None)  # checks the whole file, as diagnose would
        doc = resolve._load_yaml(path)
    except (HostError, resolve.ResolveError) as e:
        raise WatchError(str(e)) from None
    return [RunningJob(job_id=str(key)) for key in (doc.get("jobs") or {})]


def watch_reason(job: RunningJob, settings: WatchSettings) -> str | None:
    """Why the job is not watched, or None when it is."""
    if job.job_id in settings.exclude:
        return "excluded (--exclude)"
    if OPT_OUT in job.comment:
        return f"opted out (its comment says {OPT_OUT})"
    if settings.jobs and job.job_id not in settings.jobs:
        return "not one of the jobs watched"
    if settings.partitions and job.partition not in settings.partitions:
        return f"partition {job.partition or '?'} not watched"
    if settings.users and job.user not in settings.users:
        return f"user {job.user or '?'} not watched"
    try:
        check_job_id(job.job_id)
    except DiagnosisError as e:
        return str(e)
    return None


def output_state(job: RunningJob) -> tuple[tuple[int | None, ...], float] | None:
    """The sizes of the job's output files and the newest one's mtime; None when none can be read.

    lstat only: the path is the job's own text, never followed (a link) or opened, and a file that is not
    the job owner's says nothing about this job."""
    sizes: list[int | None] = []
    newest = None
    for path in job.outputs:
        try:
            st = os.lstat(path)
        except OSError:
            sizes.append(None)
            continue
        if stat.S_ISREG(st.st_mode) and (job.uid is None or st.st_uid == job.uid):
            sizes.append(st.st_size)
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
        else:
            sizes.append(None)
    return (tuple(sizes), newest) if newest is not None else None


# ---------------------------------------------------------------- the cheap signals


@dataclass
class Reading:
    """One pass's cheap signals of a job, as the collector's `--counters` reports them from every host."""

    processes: dict[tuple[str, int], dict]  # (host, pid) -> its counters row
    gpus: dict[tuple[str, str], tuple[int | None, float | None]]  # (host, GPU uuid) -> (util %, power W)
    timeout: float | None = None  # the collective timeout the ranks' environment names
    cost_ms: float = 0.0  # the collector's own time on the nodes (the slowest host)
    # Collective operations each rank completed, where a source counts them (NCCL RAS, `ncclras`: a counters
    # document's "collective_counts": {"RANK": N}); a count that grows is progress.
    collectives: dict[int, int] = field(default_factory=dict)

    @property
    def ranks(self) -> dict[int, list[tuple[str, int]]]:
        out: dict[int, list[tuple[str, int]]] = {}
        for key, row in self.processes.items():
            if isinstance(row.get("rank"), int):
                out.setdefault(row["rank"], []).append(key)
        return out


Counters = Callable[[str], "Reading | None"]

CPU_BUSY = 0.02  # a process using this share of one core between passes is computing (a hung rank: ~0.3%)
MAIN_CPU_MS = 20  # main-thread CPU milliseconds between passes that mean it ran (a blocked one adds 0)
GPU_UTIL_STEP = 5  # utilisation points, and
GPU_POWER_STEP = (
    0.10  # a share of the power draw, that mean a GPU's work changed (a spinning NCCL kernel: flat)
)


def reading_of(docs: list[dict]) -> Reading | None:
    """The counters documents of every host as one Reading; None when none found a process of the job."""
    procs: dict[tuple[str, int], dict] = {}
    gpus: dict[tuple[str, str], tuple[int | None, float | None]] = {}
    timeouts: list[float] = []
    counts: dict[int, int] = {}
    cost = 0.0
    for d in docs:
        if not isinstance(d, dict) or d.get("hangdx") != "counters":
            continue
        host = str(d.get("host") or "?")
        for row in d.get("processes") or []:
            if isinstance(row, dict) and isinstance(row.get("pid"), int):
                procs[(host, row["pid"])] = row
                t = row.get("timeout_s")
                if isinstance(t, (int, float)) and t > 0:
                    timeouts.append(float(t))
        for g in d.get("gpus") or []:
            if isinstance(g, dict):
                gpus[(host, str(g.get("uuid") or g.get("index")))] = (g.get("util"), g.get("power_w"))
        if isinstance(d.get("elapsed_ms"), (int, float)):
            cost = max(cost, float(d["elapsed_ms"]))
        for rank, n in (
            (d.get("collective_counts") or {}).items() if isinstance(d.get("collective_counts"), dict) else ()
        ):
            if str(rank).isdigit() and isinstance(n, int) and not isinstance(n, bool):
                counts[int(rank)] = max(n, counts.get(int(rank), 0))
    if not procs:
        return None
    return Reading(procs, gpus, max(timeouts) if timeouts else None, cost, counts)


def _grew(a: object, b: object) -> int:
    return b - a if isinstance(a, int) and isinstance(b, int) and b > a else 0


def moved_ranks(before: Reading, after: Reading, seconds: float) -> dict[int, str]:
    """The ranks whose own processes (the rank and its DataLoader workers) made progress between two readings,
    with how: computing (CPU), reading or writing (I/O bytes), their main thread woken (context switches). A
    process new since the last reading is progress too (a worker started)."""
    moved: dict[int, str] = {}
    busy_ms = max(1.0, seconds * 1000 * CPU_BUSY)
    for key, row in after.processes.items():
        rank = row.get("rank")
        if not isinstance(rank, int):
            continue
        old = before.processes.get(key)
        if old is None:
            moved.setdefault(rank, "a new process")
            continue
        cpu, main = (
            _grew(old.get("cpu_ms"), row.get("cpu_ms")),
            _grew(old.get("main_cpu_ms"), row.get("main_cpu_ms")),
        )
        io = _grew(old.get("io_bytes"), row.get("io_bytes"))
        switches = _grew(old.get("main_switches"), row.get("main_switches"))
        if io:
            moved.setdefault(rank, f"reading or writing (+{io} bytes)")
        elif main >= MAIN_CPU_MS or cpu >= busy_ms:
            moved.setdefault(rank, f"computing (+{max(cpu, main)} ms CPU)")
        elif switches:
            moved.setdefault(rank, f"its main thread woke {switches} times")
    for rank, n in after.collectives.items():
        done = n - before.collectives.get(rank, n)
        if done > 0:
            moved.setdefault(rank, f"completed {done} collective(s)")
    return moved


def gpus_moved(before: Reading, after: Reading) -> list[str]:
    """GPUs whose utilisation or power changed beyond noise (a kernel spinning in a hung collective stays flat)."""
    out = []
    for key, (util, power) in after.gpus.items():
        old = before.gpus.get(key)
        if old is None:
            continue
        du = abs((util or 0) - (old[0] or 0)) if util is not None and old[0] is not None else 0
        dp = abs(power - old[1]) if power is not None and old[1] is not None else 0.0
        if du >= GPU_UTIL_STEP or (old[1] and dp >= GPU_POWER_STEP * old[1]):
            out.append(f"GPU {key[1]} on {key[0]}")
    return out


def read_counters(job_id: str, opts: DiagnoseOptions) -> Reading | None:
    """The job's cheap signals from every host it runs on (the collector's --counters: milliseconds on a node,
    no ptrace); None when no process of it was found or the hosts could not be reached."""
    try:
        if opts.how == "local":
            from hangdx.probes import collector

            return reading_of([collector.counters(job_id)])
        from hangdx.bot.diagnosis import ssh_targets
        from hangdx.probes import ssh

        hosts, ssh_settings = ssh_targets(job_id, opts.how, opts)
        return reading_of(
            ssh.fan_out(hosts, ssh_settings, job_id, script=lambda h: counters_script(job_id, h.name))
        )
    except Exception as e:  # noqa: BLE001 - a pass must go on: the outputs and the probe still judge the job
        log.info("job %s: no counters: %s", job_id, " ".join(str(e).split())[:200])
        return None


def counters_script(job_id: str, host: str) -> bytes:
    """The collector's source with a trailer calling main(["--counters", ...]), for `python3 -` on a node."""
    from pathlib import Path

    from hangdx.probes import collector
    from hangdx.probes.ssh import _MAIN_GUARD

    source = _MAIN_GUARD.sub("\n", Path(collector.__file__).read_text(encoding="utf-8"))
    literal = repr(json.dumps(["--counters", "--host", host, "--", job_id]))
    return (
        source.rstrip("\n") + f'\n\nif __name__ == "__main__":\n    sys.exit(main(json.loads({literal})))\n'
    ).encode()


# ---------------------------------------------------------------- the confirmation probe


def judge(facts: Facts) -> Confirmation:
    """Stalled: every live rank is waiting (collective, sleep, lock, I/O...), its stack the same in every sample."""
    alive = [v for v in facts.ranks.values() if v.alive]
    if not alive:
        return Confirmation(None, "no live rank found" if not facts.ranks else "every rank has exited")
    if facts.progressing:
        return Confirmation(False, facts.progress_reason)
    unsampled = sorted(v.rank for v in alive if len(v.locations) < 2)
    if unsampled:
        return Confirmation(None, f"rank(s) {_ranks(unsampled)} could not be sampled twice")
    moving = sorted(v.rank for v in alive if v.moved)
    if moving:
        return Confirmation(False, f"rank(s) {_ranks(moving)} moved between samples")
    running = sorted(v.rank for v in alive if v.location.kind == "compute")
    if running:
        return Confirmation(False, f"rank(s) {_ranks(running)} running their own code")
    first = min(alive, key=lambda v: v.rank)
    where = first.location.describe()
    gone = f"; rank(s) {_ranks(facts.exited + facts.missing)} gone" if facts.exited or facts.missing else ""
    return Confirmation(
        True,
        f"every rank waiting with its stack unchanged across {len(first.locations)} samples "
        f"(rank {first.rank} {where}){gone}",
    )


def _user_calls(view) -> str | None:  # noqa: ANN001 - a facts RankView
    """Where a rank's own code is, as its two innermost calls: "`evaluate()` → `score()` (train.py:88)"."""
    from hangdx.playbooks.facts import is_library

    thread = view.stacks[-1].main_thread() if view.stacks else None
    if thread is None:
        return None
    own = [f for f in thread.frames if not f.native and not is_library(f) and f.function != "<module>"][:2]
    if not own:
        return None
    inner = own[0]
    where = f" ({os.path.basename(inner.file)}:{inner.line})" if inner.file and inner.line else ""
    return " → ".join(f"`{f.function}()`" for f in reversed(own)) + where


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def probe(job_id: str, opts: DiagnoseOptions) -> Confirmation:
    """One probe of every rank (opts.samples samples) by the diagnosis's collector, judged. The documents are the
    full bundle (stacks, process state, kernel log, GPU and fabric state, Flight Recorder dumps): kept with the
    incident when the probe confirms a hang."""
    started = time.monotonic()
    docs: list[dict] = []
    try:
        docs = collect(job_id, opts)
        facts = derive(evidence_for_job(docs, job_id))
        found = judge(facts)
        found.facts = facts
    except JobNotFound:
        # Not JobNotFound's own words: they list every job seen on the node, other users' among them.
        found = Confirmation(
            None, f"no process of job {job_id} found on the probed hosts (ended, or not there)"
        )
    except DiagnosisError as e:
        found = Confirmation(None, str(e))
    found.docs = docs
    found.seconds = time.monotonic() - started
    return found


# ---------------------------------------------------------------- what was raised, kept in Redis


class Ledger:
    """What the watchers raised, warned and said: in memory here; RedisLedger keeps it where every watcher (a
    restarted one, a second one) sees it, so that none re-diagnoses a job already raised or says a thing twice."""

    def __init__(self) -> None:
        self._keys: dict[str, float] = {}

    def claim(self, what: str, job_id: str, ttl: float) -> bool:
        """True for the first to claim (what, job) within ttl seconds."""
        key, now = f"{what}:{job_id}", time.time()
        if self._keys.get(key, 0) > now:
            return False
        self._keys[key] = now + ttl
        return True

    def has(self, what: str, job_id: str) -> bool:
        return self._keys.get(f"{what}:{job_id}", 0) > time.time()

    def release(self, what: str, job_id: str) -> None:
        self._keys.pop(f"{what}:{job_id}", None)

    def incident_open(self, job_id: str) -> bool:
        """Whether the job has an open incident (opened by an alert, a person or a watcher): no incident store here."""
        return False


class RedisLedger(Ledger):
    """The ledger in Redis. Redis unreachable ends the pass with one line (WatchError): nothing is raised without
    knowing whether it was raised already."""

    def __init__(self, conn) -> None:  # noqa: ANN001 - a redis.Redis
        from hangdx.bot.incidents import PREFIX, key_part

        self.conn, self._key = conn, lambda what, job: f"{PREFIX}watch:{what}:{key_part(job)}"

    def _do(self, fn: Callable[[], object]) -> object:
        import redis

        try:
            return fn()
        except redis.exceptions.RedisError as e:
            raise WatchError(
                f"Redis, where what was raised is kept: {' '.join(str(e).split())[:200]}"
            ) from None

    def claim(self, what: str, job_id: str, ttl: float) -> bool:
        key = self._key(what, job_id)
        return bool(self._do(lambda: self.conn.set(key, str(time.time()), nx=True, ex=max(1, int(ttl)))))

    def has(self, what: str, job_id: str) -> bool:
        return bool(self._do(lambda: self.conn.exists(self._key(what, job_id))))

    def release(self, what: str, job_id: str) -> None:
        try:
            self._do(lambda: self.conn.delete(self._key(what, job_id)))
        except WatchError as e:
            log.warning("job %s: %s", job_id, e)

    def incident_open(self, job_id: str) -> bool:
        from hangdx.bot.incidents import OPEN_SET

        return bool(self._do(lambda: self.conn.sismember(OPEN_SET, job_id)))


RAISED_TTL = 7 * 24 * 3600.0  # a job raised stays raised this long (longer than any job hangs unnoticed)
BUNDLE_TTL = 7 * 24 * 3600.0
MAX_BUNDLE_BYTES = 32 << 20


def bundle_key(job_id: str) -> str:
    from hangdx.bot.incidents import PREFIX, key_part

    return f"{PREFIX}watch:bundle:{key_part(job_id)}"


def keep_bundle(conn, job_id: str, docs: list[dict]) -> str:  # noqa: ANN001 - a redis.Redis
    """Keep the confirming probe's documents (the full bundle) with the job's incident, compressed, so that the
    diagnosis reads them even when the watchdog has killed the job since; a line for the timeline."""
    import zlib

    raw = zlib.compress(json.dumps({"taken_at": time.time(), "docs": docs}).encode(), 6)
    if len(raw) > MAX_BUNDLE_BYTES:
        return f"the bundle ({len(raw)} bytes compressed) is over {MAX_BUNDLE_BYTES} bytes: not kept"
    conn.set(bundle_key(job_id), raw, ex=int(BUNDLE_TTL))
    arts = sum(len(d.get("artifacts") or []) for d in docs)
    return f"kept the bundle taken on confirmation: {len(docs)} host(s), {arts} artifact(s), {len(raw)} bytes"


def load_bundle(conn, job_id: str) -> tuple[float, list[dict]] | None:  # noqa: ANN001 - a redis.Redis
    """The bundle a watcher kept for the job, and when it was taken; None when there is none (or it is not one)."""
    import zlib

    raw = conn.get(bundle_key(job_id))
    if not raw:
        return None
    try:
        doc = json.loads(zlib.decompress(raw, bufsize=1 << 20))
        docs = [d for d in doc["docs"] if isinstance(d, dict)]
        return float(doc["taken_at"]), docs
    except (ValueError, KeyError, TypeError, zlib.error):
        return None


def verdict_from_bundle(job_id: str, taken_at: float, docs: list[dict]):  # noqa: ANN201 - a Verdict
    """The diagnosis of the bundle a watcher kept: the evidence of the live hang, whatever became of the job."""
    from hangdx.bot.diagnosis import judge as judge_docs

    notes: list[str] = []
    started = time.monotonic()
    verdict = judge_docs(docs, job_id, set(), notes)
    when = time.strftime("%H:%M:%S UTC", time.gmtime(taken_at))
    verdict.notes = (
        [
            f"diagnosed from the evidence hangdx watch took at {when}, when it confirmed the hang (kept with the "
            "incident: the verdict stands if the job is killed since)"
        ]
        + notes
        + verdict.notes
    )
    verdict.elapsed_seconds = time.monotonic() - started
    return verdict, docs


# ---------------------------------------------------------------- the watcher

Say = Callable[
    [str, str], None
]  # (job id, text): a line in the job's incident thread, else the alert channel
Keep = Callable[[str, list], str]  # (job id, documents): keeps the bundle, a line for the timeline


@dataclass
class _Track:
    sizes: tuple[int | None, ...] | None
    quiet_since: float  # when the outputs last grew (or the job was first seen, or last probed moving)
    flat_since: float  # when any signal (outputs, counters, GPUs) last moved
    reading: Reading | None = None
    read_at: float = 0.0
    age_known: bool = True  # False: first seen with nothing to date its quiet from
    rank_flat: dict[int, float] = field(default_factory=dict)  # rank -> since when its processes are flat
    raised: bool = False
    warned: bool = False
    misses: int = 0  # probes in a row that found the flat job moving: each doubles the wait for the next
    next_probe: float = 0.0


class Watcher:
    """Keeps, per job, when its signals last moved; one check() is one pass over the running jobs."""

    def __init__(
        self,
        settings: WatchSettings,
        submit: Submit,
        list_jobs: Callable[[], list[RunningJob]] | None = None,
        confirm: Confirm | None = None,
        clock: Callable[[], float] = time.monotonic,
        counters: Counters | None = None,
        ledger: Ledger | None = None,
        keep: Keep | None = None,
        say: Say | None = None,
    ) -> None:
        self.settings = settings
        self.submit = submit
        self.list_jobs = list_jobs or _lister(settings.source)
        self.confirm = confirm or (lambda job_id: probe(job_id, settings.probe))
        self.counters = (
            counters if counters is not None else (lambda job_id: read_counters(job_id, settings.probe))
        )
        self.ledger = ledger or Ledger()
        self.keep = keep
        self.say = say
        self.clock = clock
        self.tracks: dict[str, _Track] = {}
        self.counter_ms: deque[float] = deque(
            maxlen=4096
        )  # the collector's cost per job per pass on the nodes

    def check(self) -> list[Decision]:
        """One pass: a decision per running job. Jobs that went quiet together (a shared file system hanging
        stalls every job writing to it) become one incident, and a pass probes at most PROBES_PER_PASS jobs."""
        now = self.clock()  # before the listing, whose time varies: passes stay an interval apart
        jobs = self.list_jobs()
        seen = {j.job_id for j in jobs}
        decisions: list[Decision] = []
        for gone in set(self.tracks) - seen:  # ended, or no longer running
            track = self.tracks.pop(gone)
            if track.raised:
                decisions.append(self._ended(gone, "it is no longer running"))
        due: list[tuple[RunningJob, str]] = []
        for job in jobs:
            d = self._quiet(job, now)
            if isinstance(d, Decision):
                decisions.append(d)
            else:
                due.append((job, d))
        storm = self._storm([j for j, _ in due])
        if storm:
            decisions += self._raise_storm(storm, {j.job_id: why for j, why in due}, now)
            due = [(j, why) for j, why in due if j not in storm]
        for n, (job, silent) in enumerate(due):
            if n >= PROBES_PER_PASS:
                decisions.append(Decision(job.job_id, "deferred", f"{silent}; probed in a later pass (at most "
                                          f"{PROBES_PER_PASS} probes a pass)"))  # fmt: skip
                continue
            decisions.append(self._probe(job, silent))
        return decisions

    @property
    def _window(self) -> float:
        """The confirmation window, less a little slack: two passes 30 s apart may be timed 29.99 s apart."""
        return self.settings.stall - min(1.0, 0.1 * self.settings.interval)

    def _ended(self, job_id: str, how: str) -> Decision:
        """A raised job that died (the watchdog, scancel): said once in its thread; the verdict stands."""
        text = (f"Job {job_id} has ended ({how}) since hangdx watch confirmed its hang: the verdict in this thread "
                "stands on the evidence taken while it hung.")  # fmt: skip
        if self.say is not None and self.ledger.claim("ended", job_id, RAISED_TTL):
            try:
                self.say(job_id, text)
            except Exception as e:  # noqa: BLE001 - Slack or Redis down: the decision still says it
                log.warning("job %s: could not say it ended: %s", job_id, e)
        return Decision(job_id, "ended", text)

    def _signals(self, job: RunningJob, track: _Track | None, now: float) -> tuple[Reading | None, list[str]]:
        """This pass's counters and what moved since the last pass (empty: every signal flat)."""
        reading = self.counters(job.job_id)
        if reading is not None:
            self.counter_ms.append(reading.cost_ms)
        if track is None or track.reading is None or reading is None:
            return reading, []
        moved = moved_ranks(track.reading, reading, max(0.001, now - track.read_at))
        said = [f"rank {r} {how}" for r, how in sorted(moved.items())[:3]]
        if len(moved) > 3:
            said.append(f"{len(moved) - 3} more rank(s)")
        for rank in reading.ranks:
            if rank in moved or rank not in track.rank_flat:
                track.rank_flat[rank] = now
        return reading, said + gpus_moved(track.reading, reading)

    def _quiet(self, job: RunningJob, now: float) -> Decision | str:
        """The decision when no probe is due, else how long the job has been flat (the probe's reason)."""
        why = watch_reason(job, self.settings)
        if why:
            self.tracks.pop(job.job_id, None)
            return Decision(job.job_id, "skipped", why)
        track = self.tracks.get(job.job_id)
        if track is not None and track.raised or self.ledger.has("raised", job.job_id):
            # Raised (by this watcher, an earlier one or another one): never probed or diagnosed again.
            if track is None:
                track = self.tracks[job.job_id] = _Track(None, now, now, raised=True)
            track.raised = True
            reading = self.counters(job.job_id)
            if reading is None and track.reading is not None:
                track.reading = None
                return self._ended(job.job_id, "no process of it is left")
            track.reading = reading or track.reading
            return Decision(job.job_id, "raised", "its incident is open")
        if self.ledger.incident_open(job.job_id):
            # Opened by an alert or a person (/diagnose): that incident has its diagnosis and its thread; a watcher
            # adds no second one. Once it is resolved, a job still hung is watched (and raised) afresh.
            self.tracks.pop(job.job_id, None)
            return Decision(
                job.job_id, "raised", "its incident is open (not raised by hangdx watch): left to it"
            )
        state = output_state(job)
        sizes = state[0] if state else None
        reading, moved = self._signals(job, track, now)
        if track is None:
            # Quiet since its files last changed, so that a watch (re)started after a job hung sees it at once.
            # With no file to watch, its counters date the quiet from this pass on; with neither, the job is
            # probed once it has run a stall window (a job just starting has no process to find yet).
            if state:
                quiet_since, known = now - max(0.0, time.time() - state[1]), True
            elif job.started is not None:
                quiet_since, known = now - max(0.0, time.time() - job.started), True
            else:
                quiet_since, known = now - self.settings.stall, False
            flat_since = now if reading is not None and not self.settings.once else quiet_since
            track = self.tracks[job.job_id] = _Track(sizes, quiet_since, flat_since, age_known=known)
        elif sizes is not None and sizes != track.sizes:
            track.sizes, track.quiet_since, track.age_known = sizes, now, True
            moved.insert(0, "its output grew")
        if reading is not None:
            track.reading, track.read_at = reading, now
        quiet = now - track.quiet_since
        if moved:
            track.flat_since, track.misses = now, 0
            if sizes is not None and quiet >= self.settings.quiet and now >= track.next_probe:
                # Silent this long while a counter ticks (a rank polling in a loop): the stacks say which.
                return f"no output for {quiet:.0f}s, though " + "; ".join(moved)
            track.next_probe = 0.0
            warn = self._maybe_warn(job, track, now)
            return warn or Decision(job.job_id, "moving", "; ".join(moved))
        if sizes is not None:
            silent = f"no output for {quiet:.0f}s"
        elif track.age_known and job.outputs:
            silent = f"no output file to watch, {quiet:.0f}s since it started"
        else:
            silent = "no output file to watch, age unknown"
        if reading is not None and not self.settings.once:
            flat = now - track.flat_since
            silent += (
                f"; every counter flat for {flat:.0f}s" if flat > 0 else "; counters read (first reading)"
            )
            if (flat < self._window and quiet < self.settings.quiet) or now < track.next_probe:
                return Decision(job.job_id, "quiet", silent)
            return silent
        if quiet < self._window or now < track.next_probe:
            return Decision(job.job_id, "quiet", silent)
        return silent

    def _maybe_warn(self, job: RunningJob, track: _Track, now: float) -> Decision | None:
        """Some ranks flat past half the collective timeout while another moves: sample the stacks once, and when
        the flat ones wait in a collective, warn once before the watchdog kills the job."""
        if track.warned or self.say is None or not track.rank_flat:
            return None
        timeout = (track.reading.timeout if track.reading else None) or self.settings.collective_timeout
        flat = {r: now - t for r, t in track.rank_flat.items() if now - t >= timeout / 2}
        if not flat or len(flat) == len(track.rank_flat):
            return None
        track.warned = True  # one look per job: the probe is py-spy on every rank
        found = self.confirm(job.job_id)
        facts = found.facts
        if facts is None:
            return None
        waiting = [v for r, v in facts.ranks.items() if r in flat and v.alive and v.location.kind in
                   ("collective", "p2p", "store", "init")]  # fmt: skip
        holders = [v for r, v in facts.ranks.items() if r not in flat and v.alive]
        if not waiting or not holders or not self.ledger.claim("warned", job.job_id, timeout):
            return None
        waited = max(flat[v.rank] for v in waiting)
        holder = min(holders, key=lambda v: v.rank)
        where = _user_calls(holder)
        doing = f"has been in {where}" if where else holder.location.describe()
        op = waiting[0].location.op_words or waiting[0].location.describe()
        text = (
            f"Job {job.job_id}: rank {holder.rank} {doing} for {_duration(waited)}; rank(s) "
            f"{_ranks(v.rank for v in waiting)} wait in {op}; the watchdog kills the job at {_duration(timeout)} "
            "(its collective timeout), and the evidence with it."
        )
        try:
            self.say(job.job_id, text)
        except Exception as e:  # noqa: BLE001
            log.warning("job %s: could not post the warning: %s", job.job_id, e)
        return Decision(job.job_id, "warned", text, found.seconds)

    def _probe(self, job: RunningJob, silent: str, summary: str | None = None) -> Decision:
        """Confirm one flat job by its stacks and, when stalled, keep its bundle and open its incident."""
        track = self.tracks[job.job_id]
        found = self.confirm(job.job_id)
        if not found.stalled:
            # Probed: the next probe is a window away, twice that after a second look found it moving, and so
            # on up to the quiet window: a slow job whose counters stay flat costs few probes.
            now = self.clock()
            track.quiet_since = track.flat_since = now
            track.next_probe = now + min(self.settings.quiet, self.settings.stall * 2**track.misses)
            track.misses += 1
            outcome = "moving" if found.stalled is False else "unconfirmed"
            return Decision(job.job_id, outcome, f"{silent}, but {found.reason}", found.seconds)
        summary = f"{silent}; {found.reason}" + (f". {summary}" if summary else "")
        if self.settings.dry_run:
            return Decision(job.job_id, "stalled", f"{summary} (dry run: not raised; --raise opens its incident)",
                            found.seconds)  # fmt: skip
        if not self.ledger.claim("raised", job.job_id, RAISED_TTL):
            track.raised = True
            return Decision(
                job.job_id, "raised", "its incident is open (raised by another watcher)", found.seconds
            )
        kept = ""
        if self.keep is not None and found.docs:
            try:
                kept = self.keep(job.job_id, found.docs)
            except Exception as e:  # noqa: BLE001 - Redis down: the diagnosis collects again
                kept = f"the bundle could not be kept: {' '.join(str(e).split())[:200]}"
        req = DiagnoseRequest(
            job_id=job.job_id,
            source="watch",
            requested_by=REQUESTED_BY,
            channel=self.settings.channel,
            summary=summary + (f" ({kept})" if kept else ""),
        )
        try:
            self.submit(req)
        except Exception as e:  # noqa: BLE001 - Redis or Slack down: try again next pass, say why now
            self.ledger.release("raised", job.job_id)
            why = f"could not open the incident: {' '.join(str(e).split())}"
            return Decision(job.job_id, "failed", why, found.seconds)
        track.raised = True
        return Decision(job.job_id, "stalled", req.summary or summary, found.seconds)

    def _storm(self, due: list[RunningJob]) -> list[RunningJob]:
        """The largest set of due jobs that went quiet within STORM_WINDOW of each other, when it has at least
        STORM_JOBS: one cause stalling many jobs at once is likelier than that many hangs."""
        ordered = sorted(due, key=lambda j: self.tracks[j.job_id].flat_since)
        best: list[RunningJob] = []
        lo = 0
        for hi in range(len(ordered)):
            while self.tracks[ordered[hi].job_id].flat_since - self.tracks[ordered[lo].job_id].flat_since > (
                STORM_WINDOW
            ):
                lo += 1
            if hi - lo + 1 > len(best):
                best = ordered[lo : hi + 1]
        return best if len(best) >= STORM_JOBS else []

    def _raise_storm(
        self, storm: list[RunningJob], silent: dict[RunningJob, str], now: float
    ) -> list[Decision]:
        """Probe a few jobs of the storm; the first stalled one opens the one incident, naming the others and
        what they share; every job of the storm is then counted as raised."""
        shared = shared_causes(storm)
        names = ", ".join(j.job_id for j in storm[:20]) + (
            f" and {len(storm) - 20} more" if len(storm) > 20 else ""
        )
        note = (
            f"{len(storm)} jobs went quiet within {STORM_WINDOW:.0f}s of each other ({names}): one shared cause "
            f"is likelier than {len(storm)} hangs" + (f"; they share {shared}" if shared else "")
        )
        out: list[Decision] = []
        opened = None
        for job in storm[:STORM_PROBES]:
            d = self._probe(job, silent[job.job_id], note)
            out.append(d)
            if d.outcome == "stalled":
                opened = job
                break
        probed = {d.job_id for d in out}
        for job in storm:
            if job.job_id in probed:
                continue
            if opened is None or self.settings.dry_run:
                out.append(
                    Decision(
                        job.job_id,
                        "deferred",
                        f"{silent[job.job_id]}; in a storm whose probes found no hang"
                        if opened is None
                        else f"{silent[job.job_id]}; in job {opened.job_id}'s storm (dry run)",
                    )
                )
                continue
            self.tracks[job.job_id].raised = True
            self.ledger.claim("raised", job.job_id, RAISED_TTL)
            out.append(Decision(job.job_id, "grouped", f"{silent[job.job_id]}; went quiet with job {opened.job_id}'s "
                                f"storm: in its incident"))  # fmt: skip
        return out

    def run(self, stop: threading.Event, report: Callable[[Decision], None] | None = None) -> None:
        """check() every interval until `stop` is set; `report` hears every decision."""
        while not stop.is_set():
            started = self.clock()
            try:
                decisions = self.check()
            except WatchError as e:
                decisions = [Decision("-", "failed", str(e))]
            for d in decisions:
                if report is not None:
                    report(d)
            stop.wait(max(0.0, self.settings.interval - (self.clock() - started)))


def _lister(source: str) -> Callable[[], list[RunningJob]]:
    if source == "slurm":
        return list_slurm_jobs
    if source.startswith("inventory:"):
        path = source.split(":", 1)[1]
        return lambda: list_inventory_jobs(path)
    raise WatchError(f"watch source {source!r}: expected slurm or inventory:PATH")
