"""`hangdx watch`: notice stalled jobs with nothing installed in them, and open an incident for each.

Every interval: list the running jobs (Slurm's `squeue --json`, or `scontrol show job` where Slurm is older than
21.08; or an inventory's jobs), and for each
watched job look at what costs nothing on the nodes: whether its stdout/stderr files grew. A job whose files
have not grown for the stall window gets one cheap confirmation probe (every rank sampled twice, by the
diagnosis's own collector): it is stalled when every rank is waiting (in a collective, asleep, blocked) and
no stack moved. A stalled job becomes a DiagnoseRequest for the same Service.submit an alert reaches, so it
opens (or joins) the job's one incident, which runs the full diagnosis and posts it.
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


@dataclass
class Decision:
    """What one pass concluded about one job."""

    job_id: str
    outcome: str  # skipped | moving | quiet | stalled | raised | unconfirmed | failed
    reason: str = ""
    probe_seconds: float | None = None  # how long the confirmation probe took, when one ran


@dataclass
class WatchSettings:
    source: str  # "slurm" or "inventory:PATH"
    interval: float = 60.0
    stall: float = 600.0
    partitions: frozenset[str] = frozenset()  # empty: every partition
    users: frozenset[str] = frozenset()  # empty: every user
    jobs: frozenset[str] = frozenset()  # empty: every job
    exclude: frozenset[str] = frozenset()
    probe: DiagnoseOptions = field(default_factory=lambda: DiagnoseOptions(samples=2, interval=1.0))
    channel: str | None = None  # where incidents open; None: HANGDX_ALERT_CHANNEL


@dataclass
class _Track:
    sizes: tuple[int | None, ...] | None
    quiet_since: float  # when the outputs last grew (or the job was first seen, or last probed moving)
    raised: bool = False


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


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def probe(job_id: str, opts: DiagnoseOptions) -> Confirmation:
    """One probe of every rank (opts.samples samples) by the diagnosis's collector, judged."""
    started = time.monotonic()
    try:
        docs = collect(job_id, opts)
        found = judge(derive(evidence_for_job(docs, job_id)))
    except (DiagnosisError, JobNotFound) as e:
        found = Confirmation(None, str(e))
    found.seconds = time.monotonic() - started
    return found


# ---------------------------------------------------------------- the watcher


class Watcher:
    """Keeps, per job, when its outputs last grew; one check() is one pass over the running jobs."""

    def __init__(
        self,
        settings: WatchSettings,
        submit: Submit,
        list_jobs: Callable[[], list[RunningJob]] | None = None,
        confirm: Confirm | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.submit = submit
        self.list_jobs = list_jobs or _lister(settings.source)
        self.confirm = confirm or (lambda job_id: probe(job_id, settings.probe))
        self.clock = clock
        self.tracks: dict[str, _Track] = {}

    def check(self) -> list[Decision]:
        """One pass: a decision per running job. Jobs that went quiet together (a shared file system hanging
        stalls every job writing to it) become one incident, and a pass probes at most PROBES_PER_PASS jobs."""
        jobs = self.list_jobs()
        now = self.clock()
        seen = {j.job_id for j in jobs}
        for gone in set(self.tracks) - seen:  # ended, or no longer running
            del self.tracks[gone]
        decisions: list[Decision] = []
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

    def _quiet(self, job: RunningJob, now: float) -> Decision | str:
        """The decision when no probe is due, else how long the job has been silent (the probe's reason)."""
        why = watch_reason(job, self.settings)
        if why:
            self.tracks.pop(job.job_id, None)
            return Decision(job.job_id, "skipped", why)
        state = output_state(job)
        sizes = state[0] if state else None
        track = self.tracks.get(job.job_id)
        if track is None:
            # Quiet since its files last changed, so that a watch (re)started after a job hung sees it at once.
            # With no file to watch (none, or not written yet), the probe is the only signal: probed once the job
            # has run a stall window (a job just starting has no process to find yet), then every stall window.
            if state:
                age = max(0.0, time.time() - state[1])
            elif job.started is not None:
                age = max(0.0, time.time() - job.started)
            else:
                age = self.settings.stall
            track = self.tracks[job.job_id] = _Track(sizes, now - age)
        elif sizes is not None and sizes != track.sizes:
            track.sizes, track.quiet_since, track.raised = sizes, now, False
            return Decision(job.job_id, "moving", "its output grew")
        quiet = now - track.quiet_since
        silent = (
            f"no output for {quiet:.0f}s"
            if sizes is not None
            else f"no output file to watch, {quiet:.0f}s since"
        )
        if quiet < self.settings.stall:
            return Decision(job.job_id, "quiet", silent)
        if track.raised:
            return Decision(job.job_id, "raised", f"{silent}; its incident is open")
        return silent

    def _probe(self, job: RunningJob, silent: str, summary: str | None = None) -> Decision:
        """Confirm one quiet job by its stacks and, when stalled, open its incident."""
        track = self.tracks[job.job_id]
        found = self.confirm(job.job_id)
        if not found.stalled:
            # Probed: the next probe is a stall window away, so a slow job costs one probe per window.
            track.quiet_since = self.clock()
            outcome = "moving" if found.stalled is False else "unconfirmed"
            return Decision(job.job_id, outcome, f"{silent}, but {found.reason}", found.seconds)
        summary = f"hangdx watch: {silent}; {found.reason}" + (f". {summary}" if summary else "")
        req = DiagnoseRequest(
            job_id=job.job_id,
            source="watch",
            requested_by=REQUESTED_BY,
            channel=self.settings.channel,
            summary=summary,
        )
        try:
            self.submit(req)
        except Exception as e:  # noqa: BLE001 - Redis or Slack down: try again next pass, say why now
            why = f"could not open the incident: {' '.join(str(e).split())}"
            return Decision(job.job_id, "failed", why, found.seconds)
        track.raised = True
        return Decision(job.job_id, "stalled", summary, found.seconds)

    def _storm(self, due: list[RunningJob]) -> list[RunningJob]:
        """The largest set of due jobs that went quiet within STORM_WINDOW of each other, when it has at least
        STORM_JOBS: one cause stalling many jobs at once is likelier than that many hangs."""
        ordered = sorted(due, key=lambda j: self.tracks[j.job_id].quiet_since)
        best: list[RunningJob] = []
        lo = 0
        for hi in range(len(ordered)):
            while self.tracks[ordered[hi].job_id].quiet_since - self.tracks[
                ordered[lo].job_id
            ].quiet_since > (STORM_WINDOW):
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
            if opened is None:
                out.append(
                    Decision(
                        job.job_id, "deferred", f"{silent[job.job_id]}; in a storm whose probes found no hang"
                    )
                )
                continue
            self.tracks[job.job_id].raised = True
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
