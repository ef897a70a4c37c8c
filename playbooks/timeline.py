"""What the job was doing when it stopped, from the order and times of its own log lines.

- An object-storage transfer stalled (libcurl's `Operation too slow`, `Timeout was reached`), around a checkpoint
  save: the job is stuck in checkpoint I/O.
- The last thing logged is `Saving ... checkpoint`, and the collective that timed out started at that very moment
  (its timeout time less the time it ran): the job stopped at the save.
- Training had finished, and a rank then timed out alone in a collective: it issued one the others never will.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts, votes
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.app_log import line_time
from hangdx.probes.model import LogEvent
from hangdx.probes.rx import lazy

_TIMEOUTS = ("watchdog_timeout", "gloo_timeout")


@playbook("storage_stall", order=58)
def storage_stall(facts: Facts) -> Iterator[Match]:
    """Did an object-storage transfer stall (curl below its low-speed limit, timed out), around a checkpoint?"""
    # Each line counts as its catalogue row reads it (a Lustre connection restored is no stall).
    stalls = votes(facts.ev.events_of("storage_stall"), "io_stall")
    if not stalls:
        return
    saves = [e for e in facts.ev.events_of("checkpoint_io") if e.fields.get("saving")]
    ranks = sorted({e.rank for e in stalls if e.rank is not None})
    hosts = sorted({e.host for e in stalls if e.host})
    yield Match(
        "io_stall",
        0.78 if saves else 0.6,
        Culprit(ranks=ranks, hosts=hosts),
        [e.quote for e in stalls[:3]] + [e.quote for e in saves[-2:]],
        {
            "errors": list(dict.fromkeys(str(e.fields.get("error")) for e in stalls)),
            "target": next((e.fields["target"] for e in reversed(saves) if e.fields.get("target")), None),
            "saving": bool(saves),
            "tensorstore": any(
                str(e.fields.get("where") or "").endswith("curl_transport.cc") for e in stalls
            ),
            "threads": sorted({e.fields["thread"] for e in stalls if e.fields.get("thread")}),
            "ranks": ranks,
        },
        status="hung",
    )


# c10's header `[E218 10:48:25.033625188 ProcessGroupNCCL.cpp:632]` and torch elastic's glog header
# `E1129 11:56:59.150000 29471 torch/distributed/...`: month (not zero-padded), day and time, no year.
_C10_TIME = lazy(r"\[?[EWIF](\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))? ")
# torch elastic's failure table (`time      : 2025-05-01_11:12:35`), which line_time's ISO form does not take.
_UNDERSCORE_TIME = lazy(r"\b(\d{4})-(\d\d)-(\d\d)_(\d\d):(\d\d):(\d\d)\b")
# `dmesg -T` / `journalctl -k -o short-full`: `[Mon May  1 10:22:13 2024]`; syslog's `May  1 10:22:13 node kernel:`.
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}
_CTIME = lazy(
    r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) {1,2}(\d{1,2}) (\d\d):(\d\d):(\d\d)(?: (\d{4}))?\b"
)
# How close the collective's start must be to the save line to say the job stopped there.
_SAME_MOMENT = timedelta(seconds=10)


def _event_time(e: LogEvent, year: int) -> datetime | None:
    return line_when(e.quote.text, year)


def line_when(text: str, year: int) -> datetime | None:
    """The wall-clock time a line carries near its start, in any of the forms the emitters print; `year` for the
    forms that give none (glog, syslog)."""
    t = line_time(text)
    if t is not None:
        return t
    head = text[:200]
    m = _C10_TIME.search(head)
    try:
        if m:
            frac = (m.group(6) or "0")[:6].ljust(6, "0")
            return datetime(year, *(int(m.group(i)) for i in range(1, 6)), int(frac))
        m = _UNDERSCORE_TIME.search(head)
        if m:
            return datetime(*(int(m.group(i)) for i in range(1, 7)))
        m = _CTIME.search(head)
        if m:
            y = int(m.group(6)) if m.group(6) else year
            return datetime(y, _MONTHS[m.group(1)], *(int(m.group(i)) for i in range(2, 6)))
    except ValueError:
        return None
    return None


class Clock:
    """The order of events, as an engineer reads it across ranks and files: by the wall-clock time a line carries,
    else, within one file, by its place in it (one process's output, or a launcher's merged output, is written in
    the order things happened). Events of different files without times have no order.

    Years: glog and syslog lines carry none; the year of any line that has one is used (else an arbitrary one,
    the same for every line, so that lines of one kind still compare).
    """

    TOLERANCE = timedelta(seconds=1)

    def __init__(self, events: list[LogEvent]):
        years = [t.year for e in events[:2000] if (t := line_time(e.quote.text)) is not None]
        self.year = max(set(years), key=years.count) if years else 2000
        self._times: dict[int, datetime | None] = {}

    def time(self, e: LogEvent) -> datetime | None:
        key = id(e)
        if key not in self._times:
            self._times[key] = line_when(e.quote.text, self.year)
        return self._times[key]

    def before(self, a: LogEvent, b: LogEvent) -> bool | None:
        """True when a happened before b, False when after, None when nothing read says."""
        ta, tb = self.time(a), self.time(b)
        if ta is not None and tb is not None:
            if abs(ta - tb) >= self.TOLERANCE:
                return ta < tb
            return None
        if a.quote.source == b.quote.source and a.quote.line != b.quote.line:
            return a.quote.line < b.quote.line
        return None

    def first(self, events: list[LogEvent]) -> LogEvent | None:
        """The event no other one is known to precede (the earliest by time, else by place in its file)."""
        if not events:
            return None
        timed = [e for e in events if self.time(e) is not None]
        if timed:
            return min(timed, key=lambda e: (self.time(e), e.quote.line))
        return min(events, key=lambda e: (e.quote.source, e.quote.line))


@playbook("stopped_at_save", order=63)
def stopped_at_save(facts: Facts) -> Iterator[Match]:
    """Logs: is `Saving ... checkpoint` the last word, with the timed-out collective started at that moment?"""
    if facts.have_stacks:
        return
    timeouts = [e for e in facts.ev.events_of(*_TIMEOUTS) if e.fields.get("ran_ms")]
    saves = [
        e for e in facts.ev.events_of("checkpoint_io") if e.fields.get("saving") and e.fields.get("time")
    ]
    if not timeouts or not saves:
        return
    for t in timeouts:
        before = [
            e
            for e in facts.ev.events
            if e.quote.source == t.quote.source and e.quote.line < t.quote.line and e.kind not in _TIMEOUTS
        ]
        if not before or before[-1] not in saves or before[-1].fields.get("done"):
            continue  # the save finished, or something was logged after it: the job went on past it
        save = before[-1]
        save_time = datetime.fromisoformat(save.fields["time"])
        end = _event_time(t, save_time.year)
        if end is None:
            continue
        started = end - timedelta(milliseconds=t.fields["ran_ms"])
        if abs(started - save_time) > _SAME_MOMENT:
            continue
        yield Match(
            "io_stall",
            0.5,
            Culprit(ranks=[save.rank] if save.rank is not None else []),
            [save.quote, t.quote],
            {
                "save": save.quote.text[:200],
                "saver": save.rank,
                "waiter": t.rank,
                "op": t.fields.get("op"),
                "timeout_s": round(t.fields["ran_ms"] / 1000),
                "gap_s": round(abs((started - save_time).total_seconds()), 1),
            },
            status="hung",
        )
        return


@playbook("after_finish", order=64)
def after_finish(facts: Facts) -> Iterator[Match]:
    """Logs: training had finished; does one rank then time out alone in a collective nobody else issues?"""
    if facts.have_stacks:
        return
    for done in facts.ev.events_of("training_finished"):
        later = [
            e
            for e in facts.ev.events_of(*_TIMEOUTS)
            if e.quote.source == done.quote.source and e.quote.line > done.quote.line and e.rank is not None
        ]
        earlier = [
            e
            for e in facts.ev.events_of(*_TIMEOUTS)
            if e.quote.source == done.quote.source and e.quote.line < done.quote.line
        ]
        ranks = sorted({e.rank for e in later if e.rank is not None})
        ws = facts.world_size
        if not ranks or earlier or (len(ranks) > 1 and (ws is None or 2 * len(ranks) >= ws)):
            continue
        first = later[0]
        yield Match(
            "conditional_collective",
            0.62,
            Culprit(ranks=ranks, hosts=sorted({e.host for e in later if e.host})),
            [done.quote] + [e.quote for e in later[:3]],
            {
                "ranks": ranks,
                "op": first.fields.get("op") or "a collective",
                "numel": first.fields.get("numel_in"),
                "finished": done.quote.text[:160],
            },
            status="hung",
        )
        return


# Start-up stages a job can stop in for a reason of its own, by the event kind of the line that opens them: the
# category a stop there is, and the words for it (templates/stopped_at_stage.j2).
_STAGES = {
    "extension_build": ("user_deadlock", "extension"),
    "dataloader_start": ("dataloader_stall", "dataloader"),
    # Preparing a dataset before training (indexing, tokenizing, packing: often on one rank while the others wait at
    # a barrier or in their first collective): a stop there is the data's.
    "dataset_prep": ("dataloader_stall", "data_prep"),
    # py-filelock's waits on a cache's lock file: io_stall, as an engineer reads them in training jobs, whose caches
    # (HF datasets and hub, triton's autotune, torch extensions) sit on shared home or project file systems where a
    # lock is slow to get or outlives its holder (the usual fix: the cache on local disk, the stale lock removed).
    "file_lock_wait": ("io_stall", "file_lock"),
    # NCCL's communicator set-up (src/init.cc: bootstrap, the network and topology choice, the channels' connections)
    # prints its INFO lines in order and ends with `Init COMPLETE`; a job whose every process stops among them, no
    # communicator complete and no collective run, is stuck in that set-up: a peer that never connects (a firewall or
    # blocked port on the interface NCCL chose, the wrong interface, a rank that never started).
    "nccl_setup": ("comm_init_failure", "nccl_setup"),
    # The store client's connection (c10d socket.cpp) is init_process_group's first step; after it the process waits
    # in the store for every rank, then for the backend's own connections: a last word there is a stop in set-up.
    "store_connected": ("comm_init_failure", "store_setup"),
    "store_connecting": ("comm_init_failure", "store_setup"),
}
# Event kinds that are lines of NCCL's set-up (an `nccl_init` only when it is no `Init COMPLETE`), read as one stage.
_NCCL_SETUP_KINDS = ("nccl_setup", "nccl_net", "nccl_init")


_TRAILING = (
    2  # lines a stage's line may be followed by (a wrapped tail, a closing remark) and still be the last word
)


@playbook("stopped_at_stage", order=65)
def stopped_at_stage(facts: Facts) -> Iterator[Match]:
    """Logs: is every process's last word the start of one stage: a JIT extension build, the data loaders' start, a
    cache's lock file?

    torch.utils.cpp_extension lets one process build while it holds a lock file in the extensions folder; the others
    wait in FileBaton.wait() until the file is gone, and a build killed part-way leaves it behind for every later
    run. A trainer that logs that it starts its data loaders (Composer's "Spinning the dataloaders", a streaming
    dataset's first-epoch warning) and says nothing more is waiting on them. Only when no process logged anything
    after that line: a job that went on was not stopped there.
    """
    if facts.have_stacks:
        return
    last: dict[tuple[str, int | None, str | None], LogEvent] = {}
    for e in facts.ev.events:  # by line: the catalogue's events come after the region parsers' in the list
        key = (e.quote.source, e.rank, e.host)
        if key not in last or e.quote.line >= last[key].quote.line:
            last[key] = e
    kinds = {e.kind for e in last.values()}
    if kinds <= set(_NCCL_SETUP_KINDS) and _in_nccl_setup(facts, kinds):
        kinds = {"nccl_setup"}
    stages = {_STAGES.get(k) for k in kinds}
    if len(stages) != 1 or None in stages:
        return  # some process logged something else last: it went on, or stopped elsewhere
    category, stage = stages.pop()  # type: ignore[misc]
    if stage == "store_setup" and (facts.ev.collectives or facts.ev.events_of("nccl_init")):
        return  # a process group that went on to create its communicator got past the store
    stuck = list(last.values())
    for source in {e.quote.source for e in stuck}:
        end = facts.ev.last_lines.get(source)
        at = max(e.quote.line for e in stuck if e.quote.source == source)
        if end is None or end - at > _TRAILING:
            return  # lines no reader took follow it: the text goes on past that stage
    roots = sorted({str(e.fields["root"]) for e in facts.ev.events_of(*kinds) if e.fields.get("root")})
    one_host = len({e.host for e in stuck if e.host}) == 1
    if stage == "nccl_setup" and one_host and _whole_job_on_one_host(facts, stuck):
        # On one host the ranks reach each other without a network: a set-up that stops there is, more often than
        # not, the GPUs' peer-to-peer path (PCIe ACS or the IOMMU redirecting it, GPUs whose P2P the driver offers
        # but does not deliver; NCCL's troubleshooting guide), the GPUs' side, not the job's set-up.
        category = "gpu_fault"
    else:
        one_host = False  # one node's output of a bigger job, or one process: its peers may be anywhere
    yield Match(
        category,
        0.4 if stage in ("nccl_setup", "store_setup") else 0.45,  # set-up lines may also be all a poster kept
        Culprit(
            ranks=sorted({e.rank for e in stuck if e.rank is not None}),
            hosts=sorted({e.host for e in stuck if e.host}),
        ),
        [e.quote for e in stuck[:4]],
        {
            "stage": stage,
            "roots": roots,
            "lines": len(stuck),
            "last": stuck[0].quote.text[:200],
            "one_host": one_host,
        },
        status="hung",
        template="stopped_at_stage",
    )


_NRANKS = lazy(r"\bn[Rr]anks[ =](\d{1,7})\b")


def _whole_job_on_one_host(facts: Facts, stuck: list[LogEvent]) -> bool:
    """The stuck processes are the whole job, on one host: the lines that name a host all name the same one, NCCL's
    set-up lines there come from two or more processes or GPUs, and no communicator size or world size goes beyond
    them (one node's paste of a multi-node job shows one host too)."""
    hosts = {e.host for e in stuck if e.host}
    if len(hosts) != 1:
        return False
    host = hosts.pop()
    setup = [e for e in facts.ev.events_of(*_NCCL_SETUP_KINDS) if e.host == host]
    pids = {e.pid for e in setup if e.pid is not None} | facts.ev.nccl_procs.get(host, set())
    devs = {d for e in setup if (d := e.fields.get("cuda_dev", e.fields.get("device"))) is not None}
    ranks = {
        int(r) for e in facts.ev.events if e.host == host and str(r := e.fields.get("global_rank")).isdigit()
    }
    count = max(len(pids), len(devs), len(ranks))
    if count < 2:
        return False
    # The communicator's size as NCCL prints it (`comm 0x.. rank 0 nranks 16 cudaDev 0 ...`, Init START or COMPLETE).
    sizes = [int(m.group(1)) for e in facts.ev.events if (m := _NRANKS.search(e.quote.text[:2000]))]
    if facts.world_size:
        sizes.append(facts.world_size)
    return all(n <= count for n in sizes)


def _in_nccl_setup(facts: Facts, kinds: set[str]) -> bool:
    """Every process's last word a line of NCCL's set-up, and nothing read past it: no communicator's `Init
    COMPLETE` or teardown, no collective, and a set-up line beyond NCCL's version banner (NCCL_DEBUG=VERSION prints
    only that, whatever the job does next)."""
    if facts.ev.collectives or not kinds & {"nccl_setup", "nccl_net"}:
        return False
    return not any(
        e.fields.get("complete") or e.fields.get("action") for e in facts.ev.events_of("nccl_init")
    )


# -- some ranks shut their communicator down, the others did not ----------------------------------------------

# NCCL prints `comm 0x.. rank R nranks N ... - Abort COMPLETE` (ncclCommAbort, which torch's destroy_process_group
# and process exit call) or `- Destroy COMPLETE` (ncclCommDestroy) when a process takes its communicator down.
# With no error or timeout before it, a rank that did so finished its work and left; ranks of the same communicator
# that did not are still in the job, stopped at a collective the leavers will never issue: the ranks ran
# different numbers of steps or collectives (uneven data, an extra step). The side that is fewer is the odd one.
_ENDED = ("Abort COMPLETE", "Destroy COMPLETE")
_FAILURE_KINDS = _TIMEOUTS + (
    "collective_timeout",
    "nccl_timeout",
    "desync_report",
    "monitored_barrier_failed",
    "nccl_error",
    "nccl_warn",
    "segfault",
    "rank_exit",
    "worker_died",
    "cuda_error",
)


@playbook("ranks_left_early", order=64)
def ranks_left_early(facts: Facts) -> Iterator[Match]:
    """Logs: did some ranks of a communicator take it down, with no error first, while the others never did?"""
    ends = [
        e for e in facts.ev.events_of("nccl_init") if e.fields.get("action") in _ENDED and e.rank is not None
    ]
    if not ends:
        return
    sizes = {e.fields.get("world_size") for e in ends}
    if len(sizes) != 1 or not isinstance(next(iter(sizes)), int):
        return
    n = next(iter(sizes))
    left = sorted({e.rank for e in ends if e.rank is not None})
    stayed = [r for r in range(n) if r not in left]
    if not stayed or not left or n > 4096:
        return
    first = min(e.quote.line for e in ends)
    source = ends[0].quote.source
    before = [
        e
        for e in facts.ev.events_of(*_FAILURE_KINDS)
        if e.quote.source == source and e.quote.line <= first and e not in ends
    ]
    if before:
        return  # an error first: the aborts are its teardown, not ranks that finished
    odd = stayed if len(stayed) <= len(left) else left
    bars = [e for e in facts.ev.events_of("progress") if isinstance(e.fields.get("total"), int)]
    short = [e for e in bars if isinstance(e.fields.get("n"), int) and e.fields["n"] < e.fields["total"]]
    yield Match(
        "conditional_collective",
        0.66 if short else 0.6,
        Culprit(ranks=odd),
        [e.quote for e in ends[:3]] + [e.quote for e in short[-1:]],
        {
            "left": left,
            "stayed": stayed,
            "n": n,
            "odd_left": odd == left,
            "bar": short[-1].quote.text.strip()[:120] if short else None,
        },
        status="hung",
    )
