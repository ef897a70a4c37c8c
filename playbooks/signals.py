"""Findings from the signal catalogue: what the emitters said, weighed as an on-call engineer weighs it.

Every event a catalogue row marked (`fields["signal_row"]`, see probes/signals.py) carries the row's category
and strength. Here they become findings, for whatever kind of event they are (kinds added to the catalogue
later are handled the same way, through their category and strength):

- a `decisive` row settles its category for the rank, host or GPU it names (high confidence);
- a `suggestive` row points at its category with lower confidence, higher when several rows or ranks agree,
  lower when lines of another category compete with it (the words then say both);
- timeouts are victims: a rank that waited names no culprit. With nothing else, the usual cause is a rank
  that never reached (or never finished) the collective, said with low confidence and how to confirm it; the
  timeout's own fields (its value, the op and its size, the sequence number, the work enqueued) say more;
- what the waiting side prints when it gives up is not a cause either: a worker that died of SIGABRT (how
  ProcessGroupNCCL's watchdog takes a rank down), and the lines about peers that a survivor prints after the
  timeouts (its peers tear their communicators down too). The order of events decides: a crash or lost peer
  before the first timeout is the cause, the same line after it is the teardown;
- a lost connection names the other side: `Broken pipe`, `Connection reset by peer`, `closed by remote peer`
  (EPIPE, ECONNRESET, a recv of 0 bytes) mean the peer had been connected and went away, not that it never
  came; NCCL's result 6 (ncclRemoteError, nccl.h: "a remote process exiting prematurely" or a network error)
  says the same of the call that failed;
- `context` rows settle nothing.

The engine drops a finding of this playbook that a more specific playbook already made (same category, or
the same lines as evidence): the catalogue is the floor under the flowchart, not a second opinion on it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts, row_vote, votes
from hangdx.playbooks.timeline import Clock
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent
from hangdx.probes.rx import lazy

PLAYBOOK = "signals"
# How sure a decisive line makes an engineer, by what it settles: hardware lines name the part that broke.
DECISIVE = {
    "gpu_fault": 0.86,
    "network_fault": 0.84,
    "collective_mismatch": 0.85,
    "ddp_unused_parameters": 0.85,
    "rank_crashed": 0.8,
    "comm_init_failure": 0.8,
    "dataloader_stall": 0.76,
    "io_stall": 0.74,
}
DECISIVE_DEFAULT = 0.75
SUGGESTIVE = 0.5
AGREE_BONUS = 0.05  # per other row or rank saying the same, up to AGREE_MAX
AGREE_MAX = 0.1
FIRST_BONUS = 0.05  # the category whose lines came first, when suggestive lines of several categories compete
CONFLICT = 0.05  # taken off each suggestive category that another one competes with
TIMEOUT_ALONE = 0.3
ABORTED_ALONE = 0.3
# Kinds of waiting: the line is said by a victim of the hang, not by its cause.
_WAITING = lazy(r"watchdog|collective_timeout|gloo_timeout|nccl_timeout|monitored_barrier|desync")
_ABSENTEES = lazy(r"monitored_barrier")  # these name the ranks that did not arrive
_SAFE_NAME = lazy(r"[A-Za-z0-9…][\w.\-…]{0,62}")
# A connection that had been up and went away (errno EPIPE / ECONNRESET, a recv that returned 0, gloo's and
# NCCL's words for them): the peer's process ended, or the link between them dropped. Not a set-up failure.
LOST_PEER = lazy(
    r"broken pipe|connection reset by peer|closed by (?:remote )?peer|unexpectedly closed|end of file"
    r"|remote process exited|could not receive type from localrank|connection closed by localrank",
    re.I,
)
# NCCL's result codes (nccl.h ncclResult_t), as NCCL's own lines print them: `retcode 6`, `res=6`, `-> 6`.
_NCCL_RESULT = lazy(r"\b(?:retcode|res)\s?[=:]?\s?(\d{1,2})\b|\.(?:cc|h|cu):\d{1,6} -> (\d{1,2})\b")
NCCL_REMOTE_ERROR = 6
# Kinds the hardware and the kernel report: they are no teardown's doing, whatever their order.
_HARDWARE = lazy(
    r"xid|nic_|ib_port|pcie|mce|gpu_|nvlink|nvswitch|kernel|hung_task|soft_lockup|oom|segfault|ecc|dcgm"
)
# The categories of the lines a survivor prints about its peers, or a launcher about its workers' ends.
_TEARDOWN_CATEGORIES = ("rank_crashed", "network_fault", "comm_init_failure")
# How a process that called abort() ends: torch elastic's exitcode -6, a shell's or srun's 134, signal 6.
_ABORT_CODES = (-6, 134)
_ABORT_NAMES = ("SIGABRT", "Aborted", "6")


def event_kind(e: LogEvent) -> str:
    return str(
        e.fields.get("signal_event") or e.kind
    )  # a kind kept aside for lack of fields (probes/signals.py)


def is_wait(e: LogEvent) -> bool:
    """Whether the line says its process waits in (or timed out in) a collective: a victim, never the cause."""
    return bool(_WAITING.search(event_kind(e)))


def aborted(e: LogEvent) -> bool:
    """A process that ended by abort() (SIGABRT): ProcessGroupNCCL's watchdog ends a rank so after a collective
    timeout or an NCCL error ("To avoid data inconsistency, we are taking the entire process down"; the exception
    it throws on its thread reaches std::terminate), so the exit says the rank gave up waiting, not why."""
    code = e.fields.get("exitcode", e.fields.get("exit_code"))
    if isinstance(code, int) and code in _ABORT_CODES:
        return True
    for key in ("signal", "signal_name"):
        if str(e.fields.get(key) or "") in _ABORT_NAMES:
            return True
    return False


# A worker's own failure, printed before it aborted: a CUDA error, a native crash, the OOM killer.
_OWN_ERROR_KINDS = ("cuda_error", "cuda_oom", "segfault", "oom_kill", "kernel_oops")
# Words of the errors the waiting side raises (timeouts, lost peers, NCCL and gloo errors): no error of its own.
_COMM_WORDS = ("timed out", "timeout", "connection", "watchdog", "nccl", "gloo", "peer")


def own_error(facts: Facts, rank: int | None = None) -> bool:
    """Does the text show an error of a process's own (of `rank`, when given): an exception that is not the
    waiting side's, a CUDA error, a crash, a decisive line? Then an abort that follows it is that error's."""

    def mine(e: LogEvent) -> bool:
        return rank is None or e.rank is None or e.rank == rank

    if any(mine(e) for e in votes(facts.ev.events_of(*_OWN_ERROR_KINDS), None)):
        return True
    for e in facts.ev.events_of("exception"):
        if mine(e) and not any(w in e.quote.text.lower() for w in _COMM_WORDS):
            return True
    return any(
        mine(e)
        and e.fields.get("signal_strength") == "decisive"
        and e.fields.get("signal_category") not in (None, "comm_init_failure")
        for e in facts.ev.events
    )


# ibverbs' ibv_wc_status 5, IBV_WC_WR_FLUSH_ERR: "a Work Request was in process or outstanding when the QP
# transitioned into the Error State". Every request queued after a QP's first error completes with it: the
# echo of an earlier failure (its first error, or a peer that went away), never the first failure itself.
IBV_WC_WR_FLUSH_ERR = 5
_IB_STATUS = lazy(r"with (?:error|status) (\d{1,3})\b")


def flushed(e: LogEvent) -> bool:
    """An InfiniBand completion that only says the queue pair had already failed (status 5, flushed)."""
    if "completion" not in event_kind(e) and "completion" not in e.quote.text[:300].lower():
        return False
    status = e.fields.get("errno", e.fields.get("status"))
    if not str(status).isdigit():
        m = _IB_STATUS.search(e.quote.text[:600])
        status = m.group(1) if m else None
    return str(status) == str(IBV_WC_WR_FLUSH_ERR)


def own_crashes(facts: Facts) -> list[LogEvent]:
    """Lines of a process's own end: a decisive crash line (OOM killer, segfault, CUDA OOM), a CUDA error, an exit
    by a signal other than the launcher's SIGTERM or the watchdog's SIGABRT."""
    out = []
    for e in facts.ev.events:
        if (
            e.fields.get("signal_category") == "rank_crashed"
            and e.fields.get("signal_strength") == "decisive"
        ):
            out.append(e)
        elif e.kind in _OWN_ERROR_KINDS and row_vote(e, None):
            out.append(e)  # a context row of the kind (an allocator's summary, a hint line) is no crash
    return out


def after_a_crash(e: LogEvent, crashes: list[LogEvent], clock: Clock) -> bool:
    """A line about a peer that stopped answering (an IB completion error, a lost connection) printed after a
    process's own crash: the crash is why it stopped answering (ibverbs: a transport retry exceeded after the
    first message means "the remote QP isn't available anymore")."""
    return bool(e.fields.get("peer")) and any(clock.before(c, e) is True for c in crashes if c is not e)


_COMM_CATEGORIES = ("comm_init_failure", "network_fault")


def after_own_comm_error(e: LogEvent, marked: list[LogEvent], clock: Clock) -> bool:
    """A process's crash (a segfault) printed after that same process (host and pid) reported its own failure to
    set up or use its connections (NCCL's proxy Connect, a transport or IB error): the crash happened on the
    error's path (a half-built communicator torn down), so the first failure is the cause, as an engineer orders a
    process's story."""
    if (
        e.fields.get("signal_category") != "rank_crashed"
        or e.kind != "segfault"
        or e.pid is None
        or not e.host
    ):
        return False
    return any(
        o.fields.get("signal_category") in _COMM_CATEGORIES
        and not is_wait(o)
        and o.pid == e.pid
        and o.host == e.host
        and clock.before(o, e) is True
        for o in marked
        if o is not e
    )


def lost_peer(e: LogEvent) -> bool:
    """A line saying an established connection to a peer went away (the survivor's side of a peer's end)."""
    text = " ".join(str(e.fields.get(k) or "") for k in ("error", "reason", "message"))
    return bool(LOST_PEER.search(text) or LOST_PEER.search(e.quote.text[:600]))


# Kinds of line that report another process's or node's end, printed by whoever saw it (Ray's driver and GCS, a
# launcher, slurmctld's verdict in a surviving node's banner, NCCL RAS): never by the process that ended.
OBSERVED_ENDS = frozenset({"worker_died", "node_failure", "rank_unreachable"})


def _survivor(e: LogEvent) -> bool:
    """Printed by the side that is still there, about the side that went away: a lost connection, NCCL's remote
    error (result 6: "a remote process exited"), a report of another process's end."""
    return (
        lost_peer(e)
        or e.fields.get("signal_reading") == "remote_error"
        or event_kind(e) in OBSERVED_ENDS
        or ("NCCL" in e.quote.text and NCCL_REMOTE_ERROR in nccl_results([e]))
    )


def nccl_results(events: list[LogEvent]) -> set[int]:
    """The ncclResult_t codes NCCL's own lines report for the failure (its `retcode`, `res=`, `file:line -> N`)."""
    out: set[int] = set()
    for e in events:
        for key in ("retcode", "result"):
            v = e.fields.get(key)
            if str(v).isdigit():
                out.add(int(str(v)))
        if "NCCL" in e.quote.text or e.fields.get("signal_row", "").startswith("nccl"):
            for m in _NCCL_RESULT.finditer(e.quote.text[:600]):
                out.add(int(m.group(1) or m.group(2)))
    out.discard(0)
    return out


def _gpu(e: LogEvent) -> str | None:
    for key in ("bus_id", "gpu", "gpu_uuid"):
        value = e.fields.get(key)
        if value not in (None, ""):
            return f"{e.host}:{value}" if e.host else str(value)
    return None


_PORT = lazy(r"<\d{1,5}>$|:\d{1,5}$")


def peer_host(e: LogEvent) -> str | None:
    """The peer a line names (`closed by remote peer node2<55555>`, `[10.0.0.7]:35411`), without its port."""
    value = e.fields.get("peer")
    if not value or str(value).isdigit():
        return None  # a bare number is a rank (or a local rank), not a host
    return _PORT.sub("", str(value).strip("[]")).strip("[]") or None


def subject_host(e: LogEvent) -> str | None:
    """The host of the process a line is about, when the line names it: its peer (the other end of a connection),
    or the node a launcher or scheduler names for the task that ended (srun's `node17: task 3`, mpirun's `on node
    X`, Hydra's `RUNNING AT X`)."""
    peer = peer_host(e)
    if peer:
        return peer
    node = e.fields.get("node")
    if isinstance(node, str) and _SAFE_NAME.fullmatch(node) and not node.isdigit() and not node.isupper():
        return node
    return None


def named_ranks(e: LogEvent) -> list[int]:
    """The ranks a line is about that are not the rank printing it: a list of ranks a row names (the stragglers a
    detector measured, the ranks that never reached a barrier), the rank at the other end of a failed connection."""
    out = (
        [r for r in e.fields.get("ranks") or [] if isinstance(r, int)]
        if isinstance(e.fields.get("ranks"), list)
        else []
    )
    peer = e.fields.get("peer_rank")
    if isinstance(peer, int):
        out.append(peer)
    return sorted(set(out))


# Lines printed by the rank that received another rank's wrong data (a generator state that came over a broadcast
# matched with a different collective): the printer is where the divergence showed, not the rank that diverged.
_RECEIVERS = frozenset({"rng_state_garbled"})

# Categories whose lines name the far end of a path that failed (a link, a connection that could not be made):
# the peer's host is a suspect as much as the printer's.
_BOTH_ENDS = ("network_fault", "comm_init_failure")


def loopback(host: str) -> bool:
    """A peer on the loopback interface is on the printer's own machine: the address names no host."""
    return host in ("localhost", "::1") or host.startswith("127.")


def _peer_process(e: LogEvent) -> str:
    """The other process a line is about, by its pid and (not on loopback) its node: Ray's `pid:` and `ip:`."""
    host = subject_host(e)
    return f"{host + ' ' if host and not loopback(host) else ''}pid {e.fields['peer_pid']}"


def _culprit(events: list[LogEvent], category: str = "") -> Culprit:
    """Who the lines name. For a crash, a line that says its peer went away is printed by the survivor: the peer
    it names is the culprit (a host, a rank, or a local rank on the printer's own host); a survivor that names no
    peer names nobody. A line that names other ranks (stragglers, absentees) names them, not its printer. A link or
    connection that failed names both ends."""
    if category == "rank_crashed":
        blamed = [e for e in events if subject_host(e) or isinstance(e.fields.get("peer_rank"), int)]
        local = [
            e for e in events if e not in blamed and lost_peer(e) and e.fields.get("local_rank") is not None
        ]
        own = [e for e in events if e not in blamed and e not in local and not _survivor(e)]
        if blamed or local or len(own) < len(events):
            c = _culprit(own) if own else Culprit()
            c.ranks = sorted(set(c.ranks) | {r for e in blamed for r in named_ranks(e)})
            c.hosts = sorted(
                set(c.hosts)
                | {p for e in blamed if (p := subject_host(e)) and not loopback(p)}
                | {e.host for e in local if e.host}
            )
            c.processes = list(
                dict.fromkeys(
                    c.processes
                    + [f"{e.host + ' ' if e.host else ''}local rank {e.fields['local_rank']}" for e in local]
                    + [_peer_process(e) for e in blamed if isinstance(e.fields.get("peer_pid"), int)]
                )
            )[:8]
            return c
    speakers = [e for e in events if not named_ranks(e) and e.kind not in _RECEIVERS]
    ranks = sorted(
        {e.rank for e in speakers if e.rank is not None} | {r for e in events for r in named_ranks(e)}
    )
    hosts = {e.host for e in speakers if e.host}
    if category in _BOTH_ENDS:
        hosts |= {p for e in events if (p := peer_host(e)) and not loopback(p)}
    gpus = list(dict.fromkeys(g for e in speakers if (g := _gpu(e))))
    links = (
        list(dict.fromkeys(x for e in events if (x := fabric_port(e)))) if category == "network_fault" else []
    )
    procs = []
    if not ranks:
        procs = list(
            dict.fromkeys(f"{e.host} pid {e.pid}" if e.host else f"pid {e.pid}" for e in speakers if e.pid)
        )
    return Culprit(ranks=ranks, hosts=sorted(hosts), gpus=gpus, links=links[:8], processes=procs[:8])


def fabric_port(e: LogEvent) -> str | None:
    """The fabric port a line is about, as the network playbook names ports (`host:ca/port`): the HCA and its port
    that NCCL's IB lines (`mlx5_0:1`) and rdma-core's tools (`rdma link`: `mlx5_1/1`) name. A number is no HCA
    (`GPU Direct RDMA ... for HCA 0`)."""
    dev, port = e.fields.get("hca"), e.fields.get("port")
    if not (isinstance(dev, str) and dev and not dev.isdigit()):
        return None
    name = f"{dev}/{port}" if isinstance(port, int) or (isinstance(port, str) and port.isdigit()) else dev
    return f"{e.host}:{name}" if e.host else name


def _the_one_aborted(facts: Facts, events: list[LogEvent]) -> list[int]:
    """A launcher's abort table (MPICH's `job aborted:`) naming one process: a line printed without a rank in the
    same output (an MPI error stack) is that process's. Two or more processes named: no telling whose it is."""
    sources = {e.quote.source for e in events}
    ranks = {
        e.rank
        for e in facts.ev.events_of("mpi_abort_entry")
        if e.rank is not None and e.quote.source in sources
    }
    return sorted(ranks) if len(ranks) == 1 else []


def _said(events: list[LogEvent]) -> list[dict[str, Any]]:
    """What each row saw, once per row: for the words of the finding."""
    from hangdx.probes import catalogue

    try:
        rows = catalogue.load().by_id
    except catalogue.CatalogueError:
        rows = {}
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        rid = str(e.fields.get("signal_row") or e.kind)
        if rid not in out:
            row = rows.get(rid)
            out[rid] = {
                "id": rid,
                "emitter": row.emitter if row else "",
                # A line read for what it says of its peer: the reading is its meaning, not the row's generic one.
                "meaning": row.meaning if row and not e.fields.get("signal_reading") else "",
                "line": " ".join(e.quote.text.split())[:200],
                "count": 0,
            }
        out[rid]["count"] += 1
    return list(out.values())


def _where(c: Culprit) -> dict[str, Any]:
    """Names safe to put in a suggested command (a log's text is never a command's target as it stands)."""
    hosts = [h for h in c.hosts if _SAFE_NAME.fullmatch(h)]
    return {"host": hosts[0] if len(hosts) == 1 and not hosts[0].startswith("…") else None, "ranks": c.ranks}


def _confidence(base: float, events: list[LogEvent]) -> float:
    rows = {e.fields.get("signal_row") for e in events}
    speakers = {(e.host, e.rank, e.pid) for e in events}
    agree = (len(rows) - 1) + (len(speakers) - 1)
    return round(base + min(AGREE_MAX, AGREE_BONUS * agree), 2)


def _as(e: LogEvent, category: str, reading: str) -> LogEvent:
    """The event read as another category than its row's (a copy: other playbooks keep the original)."""
    fields = {
        **e.fields,
        "signal_category": category,
        "signal_strength": "suggestive",
        "signal_row": e.fields.get("signal_row") or e.kind,
        "signal_reading": reading,
    }
    return dataclasses.replace(e, fields=fields)


def _readings(facts: Facts) -> tuple[list[LogEvent], set[int]]:
    """The marked events, each with the category an engineer reads in it.

    - A lost connection a region parser read (a socket error naming its peer) is the survivor's side of the
      peer's end, whatever row marked it, and so is a set-up line that failed with NCCL's remote error (6):
      a remote process exited (or the network dropped), which NCCL's own result code says.
    """
    results = nccl_results(
        [e for e in facts.ev.events if e.kind in ("nccl_check_trace", "nccl_warn", "nccl_error", "signal")]
    )
    out = []
    cut = [t for t in facts.ev.events_of("traceback_cut") if t.fields.get("where") in TRACEBACK_END]
    # NCCL's INFO lines about a closed connection are also what every normal end prints (ncclCommDestroy closes
    # them all): they say a peer went away only beside a failure.
    failing = any(e.fields.get("signal_category") or is_wait(e) for e in facts.ev.events)
    for e in facts.ev.events:
        names_peer = bool(e.fields.get("peer")) or e.fields.get("local_rank") is not None
        if not e.fields.get("signal_row") and not names_peer:
            continue
        category = e.fields.get("signal_category")
        if category == "network_fault" and flushed(e):
            continue  # the echo of the queue pair's first failure: the lines around it say which
        if is_wait(e):
            if category:
                out.append(e)
            continue
        if (
            names_peer
            and lost_peer(e)
            and category in (None, "comm_init_failure")
            and (failing or " NCCL INFO " not in e.quote.text)
        ):
            out.append(_as(e, "rank_crashed", "lost_peer"))
        elif (
            category == "comm_init_failure"
            and e.fields.get("signal_strength") != "decisive"
            and (NCCL_REMOTE_ERROR in nccl_results([e]))
        ):
            out.append(_as(e, "rank_crashed", "remote_error"))
        elif (
            category == "rank_crashed"
            and e.fields.get("signal_strength") != "decisive"
            and (tb := _traceback_after(e, cut)) is not None
        ):
            read = _as(e, TRACEBACK_END[str(tb.fields["where"])], "traceback_end")
            read.fields["traceback_end"] = (tb.fields.get("frames") or [""])[-1]
            out.append(read)
        elif category and e.fields.get("signal_row"):
            out.append(e)
    return out, results


# Where a traceback cut before its exception ends (the taxonomy of waits, probes/waits.yaml), as a category: a
# process that failed inside the DataLoader's code failed in its input pipeline, one inside a file read in I/O.
TRACEBACK_END = {"data": "dataloader_stall", "storage": "io_stall"}
TRACEBACK_GAP = 3  # lines between a line that says a process raised and the traceback it introduces


def _traceback_after(e: LogEvent, cut: list[LogEvent]) -> LogEvent | None:
    """The traceback a line introduces (`-- Process 5 terminated with the following error:`, then its traceback):
    one that starts right after it in the same text. Its end, not the line, says where the process failed."""
    for t in cut:
        start = t.fields.get("start")
        if (
            t.quote.source == e.quote.source
            and isinstance(start, int)
            and 0 < start - e.quote.line <= TRACEBACK_GAP
        ):
            return t
    return None


def _casualty(
    e: LogEvent, waiting: list[LogEvent], clock: Clock, waiters: set[int], absent: set[int], single: bool
) -> str | None:
    """Why a line beside collective timeouts is their consequence, not their cause (None: it may be the cause).

    An engineer orders the events: the first failure is the cause, what follows the timeouts is the teardown
    (the waiting ranks abort, their peers see closed sockets and remote errors, launchers stop the rest). A
    decisive line (the OOM killer, a segfault, an Xid) is a part's own failure whatever its place.
    """
    if not waiting or e.fields.get("signal_strength") == "decisive":
        return None
    if aborted(e):
        return "abort"
    category = str(e.fields.get("signal_category"))
    if category not in _TEARDOWN_CATEGORIES or _HARDWARE.search(event_kind(e)):
        return None
    order = [o for w in waiting if (o := clock.before(e, w)) is not None]
    if order and all(order):
        return None  # before every timeout it can be placed against: the first failure
    if order:
        return "after"  # printed once the timeouts had fired (or while they did)
    if category != "rank_crashed":
        return None
    rank = _rank_named(e, single)
    if rank is not None and waiters and rank not in waiters and (rank in absent or not absent):
        return None  # the rank that did not wait is the one that died
    return "unordered"  # a crash line nothing places before the timeouts: read as what every rank's end looks like


def _rank_named(e: LogEvent, single: bool) -> int | None:
    """The rank a line is of: its own, or the local rank a launcher names when the job is on one node."""
    if e.rank is not None:
        return e.rank
    local = e.fields.get("local_rank")
    if single and str(local).isdigit() and not lost_peer(e):
        return int(str(local))
    return None


def _the_host(facts: Facts) -> str | None:
    """The one host a text names, when it names exactly one (localhost tells no machine apart)."""
    hosts = {e.host for e in facts.ev.events if e.host} | set(facts.ev.hosts)
    if len(hosts) != 1:
        return None
    host = next(iter(hosts))
    return host if _SAFE_NAME.fullmatch(host) and not loopback(host) else None


def _one_host(facts: Facts) -> bool:
    """Nothing read names a second host (a paste of one node's output, or of a job on one node)."""
    return len({e.host for e in facts.ev.events if e.host} | set(facts.ev.hosts)) <= 1


@dataclasses.dataclass
class _Waits:
    """Who waited, in a group of how many, and who of the group said nothing."""

    reporters: list[int]
    group: int | None
    exact: bool  # the group's size is known (WORLD_SIZE, an all-gather's sizes), not only a lower bound
    unheard: list[int]


def _waits(facts: Facts, waiting: list[LogEvent]) -> _Waits:
    reporters = sorted({e.rank for e in waiting if e.rank is not None})
    group = _group_size(facts, waiting)
    exact = group is not None
    unheard = sorted(set(range(group)) - set(reporters)) if group and reporters else []
    if group is None and reporters:
        # Ranks count from 0: the highest rank named is a lower bound of the group, and a rank below it that
        # nothing at all was read from is unheard (a rank that printed something else is not).
        named = {e.rank for e in facts.ev.events if e.rank is not None} | {
            c.rank for c in facts.ev.collectives if c.rank is not None
        }
        group = max(named) + 1
        unheard = sorted(set(range(group)) - named)
    return _Waits(reporters, group, exact, unheard)


@playbook(PLAYBOOK, order=97)
def signals(facts: Facts) -> Iterator[Match]:
    """What the lines of the signal catalogue say, when no more specific playbook said it."""
    marked, results = _readings(facts)
    marked = [e for e in marked if e.fields.get("signal_category")]
    clock = Clock(facts.ev.events)
    waiting = [e for e in marked if is_wait(e)]
    waiters = {e.rank for e in waiting if e.rank is not None}
    waits = _waits(facts, waiting)
    single = _one_host(facts)
    causes: list[LogEvent] = []
    casualties: list[tuple[LogEvent, str]] = []
    crashes = own_crashes(facts)
    for e in marked:
        if is_wait(e):
            continue
        why = _casualty(e, waiting, clock, waiters, set(waits.unheard), single)
        if (
            why is None
            and e.fields.get("signal_category") == "network_fault"
            and after_a_crash(e, crashes, clock)
        ):
            why = "after_crash"
        if why is None and aborted(e) and e.fields.get("signal_category") == "rank_crashed":
            why = "abort"  # a SIGABRT exit says how the rank ended, not what made it end
        if why is None and after_own_comm_error(e, marked, clock):
            why = "after_own_error"
        if why:
            casualties.append((e, why))
        else:
            causes.append(e)
    if waiting:
        # A worker's SIGABRT exit that its row reads as context (torch elastic's `failed (exitcode: -6)`): still how
        # a waiting rank ended, and the words say so.
        seen = {id(e) for e in marked}
        casualties += [
            (e, "abort")
            for e in facts.ev.events
            if id(e) not in seen and e.fields.get("signal_row") and aborted(e)
        ]
    by_cat: dict[str, dict[str, list[LogEvent]]] = {}
    for e in causes:
        strength = e.fields.get("signal_strength")
        by_cat.setdefault(str(e.fields["signal_category"]), {}).setdefault(str(strength), []).append(e)
    chosen = {
        c: (s.get("decisive") or s.get("suggestive") or [], bool(s.get("decisive")))
        for c, s in by_cat.items()
    }
    chosen = {c: v for c, v in chosen.items() if v[0]}
    first = _first_category(chosen, clock)
    suggestive_only = [c for c, (_, decisive) in chosen.items() if not decisive]
    for category, (events, decisive) in chosen.items():
        base = DECISIVE.get(category, DECISIVE_DEFAULT) if decisive else SUGGESTIVE
        conf = _confidence(base, events)
        rivals = [c for c in chosen if c != category and (not chosen[c][1] or not decisive)]
        if not decisive and len(suggestive_only) > 1:
            conf += FIRST_BONUS if category == first else -CONFLICT
        culprit = _culprit(events, category)
        named_by: list[LogEvent] = []
        if decisive and not (culprit.ranks or culprit.hosts or culprit.gpus):
            # The decisive line says how (slurmstepd's `Detected 1 oom_kill event`), a suggestive line of the same
            # category says who (srun's `error: node7: task 3: Killed`): two lines of one death, the second names it.
            backing = by_cat.get(category, {}).get("suggestive", [])
            more = _culprit(backing, category) if backing else Culprit()
            if more.ranks or more.hosts or more.gpus:
                culprit, named_by = more, backing[:2]
        if not culprit.ranks:
            culprit.ranks = _the_one_aborted(facts, events)
        if (
            not (culprit.ranks or culprit.hosts)
            and (host := _the_host(facts))
            and not all(map(_survivor, events))
        ):
            # One node's output (a paste whose every line that names a host names the same one): a line of a
            # process's own end that names no host happened there (slurmstepd's banner names its node, its OOM
            # report does not).
            culprit.hosts = [host]
        agrees = False
        if category == "rank_crashed" and waiting:
            named = sorted(
                {r for e in events if (r := _rank_named(e, single)) is not None and r not in waiters}
            )
            if not culprit.ranks and named:
                culprit.ranks = named
            # Two things that agree: the rank that died is one that never reported waiting.
            agrees = bool(culprit.ranks) and set(culprit.ranks) <= set(waits.unheard)
            if agrees:
                conf += AGREE_MAX
        lead = _lead(events, waiting, clock)
        victims = sorted({e.rank for e in waiting if e.rank is not None} - set(culprit.ranks))
        yield Match(
            category,
            round(conf, 2),
            culprit,
            [e.quote for e in events[:6]] + [e.quote for e in named_by] + [e.quote for e in waiting[:2]],
            {
                "category": category,
                "strength": "decisive" if decisive else "suggestive",
                "said": _said(events),
                "victims": victims,
                "where": _where(culprit),
                "alone": False,
                "readings": sorted(
                    {str(e.fields["signal_reading"]) for e in events if e.fields.get("signal_reading")}
                ),
                "ends": list(
                    dict.fromkeys(
                        str(e.fields["traceback_end"]) for e in events if e.fields.get("traceback_end")
                    )
                ),
                "remote_error": NCCL_REMOTE_ERROR in results,
                "came_first": category == first and len(chosen) > 1,
                "rivals": rivals,
                "teardown": len([c for c in casualties if c[1] != "after_crash"]),
                "echoes": len([c for c in casualties if c[1] == "after_crash"])
                if category == "rank_crashed"
                else 0,
                "agrees": agrees,
                "lead": lead,
                "observed": all(map(_survivor, events)),
                # The NVSwitch fabric's set-up, not a broken part (an SXid or a switch port down): NCCL's NVLink
                # SHARP set-up failing (fixed on the node, avoidable by turning NVLS off) or the Fabric Manager not
                # running (the fabric never configured). Each has its own words.
                "nvls": category == "gpu_fault" and _all_rows(events, "nccl.nvls."),
                "fabric_manager": category == "gpu_fault" and _all_rows(events, "nvidia.fabricmanager."),
            },
            status="failed" if category == "rank_crashed" else None,
            template=PLAYBOOK,
        )
    if (waiting or casualties) and not chosen:
        yield _waiting_alone(facts, waiting, casualties)
    if not marked:
        context = [e for e in facts.ev.events if e.fields.get("signal_strength") == "context"]
        remote = [e for e in context if NCCL_REMOTE_ERROR in nccl_results([e])]
        if remote:
            yield _remote_only(remote, context)
        elif context:
            yield _context_only(context)


REMOTE_ONLY = 0.4


def _remote_only(remote: list[LogEvent], context: list[LogEvent]) -> Match:
    """Only NCCL's trace of a failure, and its result code is 6 (ncclRemoteError: a remote process exited
    prematurely, or the network failed): the peer's end is the likelier reading, said at low confidence."""
    warned = [e for e in context if "NCCL WARN" in e.quote.text] or remote
    culprit = Culprit(hosts=sorted({p for e in warned if (p := peer_host(e))}))
    return Match(
        "rank_crashed",
        REMOTE_ONLY,
        culprit,
        [e.quote for e in (warned[:3] + remote[:2])],
        {
            "category": "rank_crashed",
            "strength": "suggestive",
            "said": _said([_as(e, "rank_crashed", "remote_error") for e in warned]),
            "victims": [],
            "where": _where(culprit),
            "alone": False,
            "readings": ["remote_error"],
            "remote_error": True,
            "came_first": False,
            "rivals": [],
            "teardown": 0,
            "echoes": 0,
            "agrees": False,
            "lead": "",
        },
        status="failed",
        template=PLAYBOOK,
    )


def _all_rows(events: list[LogEvent], prefix: str) -> bool:
    """Every line was read by a catalogue row whose id starts with prefix."""
    return bool(events) and all(str(e.fields.get("signal_row") or "").startswith(prefix) for e in events)


def _lead(events: list[LogEvent], waiting: list[LogEvent], clock: Clock) -> str:
    """How long before the first timeout the first of these lines came, in words ("" when no time says)."""
    head = clock.first(events)
    timed = [w for w in waiting if clock.time(w) is not None]
    if head is None or clock.time(head) is None or not timed:
        return ""
    first_wait = min(timed, key=lambda w: clock.time(w))
    gap = (clock.time(first_wait) - clock.time(head)).total_seconds()
    if gap < 1:
        return ""
    return f"{gap / 60:.0f} min" if gap >= 120 else f"{gap:.0f} s"


def _first_category(chosen: dict[str, tuple[list[LogEvent], bool]], clock: Clock) -> str | None:
    """The category whose earliest line comes before every other category's earliest line."""
    heads = {c: clock.first(events) for c, (events, _) in chosen.items()}
    heads = {c: e for c, e in heads.items() if e is not None}
    for c, e in heads.items():
        if all(clock.before(e, o) is True for d, o in heads.items() if d != c) and len(heads) > 1:
            return c
    return None


CONTEXT_ONLY = 0.12  # above what_next's 0.1: it says what was seen, and still names no cause


def _context_only(events: list[LogEvent]) -> Match:
    """Lines the catalogue knows but that settle nothing (a bare NCCL warning, a version banner): say them."""
    return Match(
        "unknown",
        CONTEXT_ONLY,
        _culprit(events[:1]) if len({(e.host, e.rank) for e in events}) == 1 else Culprit(),
        [e.quote for e in events[:4]],
        {
            "category": "unknown",
            "strength": "context",
            "said": _said(events),
            "victims": [],
            "where": {},
            "alone": False,
            "context_only": True,
        },  # fmt: skip
        template=PLAYBOOK,
    )


# PyTorch's default collective timeouts: ProcessGroupNCCL's kProcessGroupNCCLDefaultTimeout (10 min, PyTorch >= 2.2)
# and default_pg_timeout (30 min: gloo, NCCL before 2.2, and what DeepSpeed, HF Trainer and accelerate pass).
DEFAULT_TIMEOUTS_MS = (600_000, 1_800_000)
# An op at or below this many elements is a synchronisation point, not data: a barrier, a flag or a scalar.
SYNC_NUMEL = 1
# At or above this many elements it is a gradient bucket, a parameter shard or an activation: mid-step data.
BULK_NUMEL = 1 << 20


def _group_size(facts: Facts, waiting: list[LogEvent]) -> int | None:
    """How many ranks the timed-out collective's group has: WORLD_SIZE, or what an all-gather's sizes say of
    the default group (NumelOut = NumelIn x group size, ProcessGroupNCCL's WorkNCCL fields)."""
    if facts.world_size:
        return facts.world_size
    for e in waiting:
        op = str(e.fields.get("op") or "").lower()
        n_in, n_out = e.fields.get("numel_in"), e.fields.get("numel_out")
        default_pg = str(e.fields.get("pg") or "0") == "0" or e.fields.get("pg_name") == "default_pg"
        if (
            default_pg
            and "allgather" in op.replace("_", "")
            and isinstance(n_in, int)
            and isinstance(n_out, int)
            and n_in > 0
            and n_out % n_in == 0
            and 1 < n_out // n_in <= 65536
        ):
            return n_out // n_in
    return None


def _wait_reading(facts: Facts, waiting: list[LogEvent]) -> dict[str, Any]:
    """What the timeout lines' own fields say (ProcessGroupNCCL's `WorkNCCL(SeqNum, OpType, NumelIn, NumelOut,
    Timeout(ms))` and its PG status `last enqueued work / last completed work`)."""
    timeouts = sorted(
        {e.fields["timeout_ms"] for e in waiting if isinstance(e.fields.get("timeout_ms"), int)}
    )
    numels = [e.fields["numel_in"] for e in waiting if isinstance(e.fields.get("numel_in"), int)]
    ops = {str(e.fields.get("op") or "").lower() for e in waiting if e.fields.get("op")}
    seqs = sorted({int(e.fields["seq"]) for e in waiting if isinstance(e.fields.get("seq"), int)})
    sync = bool(ops) and (ops <= {"barrier"} or (bool(numels) and max(numels) <= SYNC_NUMEL))
    bulk = bool(numels) and min(numels) >= BULK_NUMEL
    ahead: dict[int, int] = {}
    for e in facts.ev.events_of("work_progress"):
        enq, at = e.fields.get("last_enqueued"), e.fields.get("at_work")
        if e.rank is not None and isinstance(enq, int) and isinstance(at, int) and enq > at:
            ahead[e.rank] = enq - at
    short = bool(timeouts) and max(timeouts) < min(DEFAULT_TIMEOUTS_MS)
    return {
        "timeout_s": [round(t / 1000) for t in timeouts],
        "short_timeout": short,
        "default_timeout": bool(timeouts) and all(t in DEFAULT_TIMEOUTS_MS for t in timeouts),
        "sync_point": sync,
        "bulk": bulk,
        "numel": max(numels) if numels else None,
        "first_collective": bool(seqs) and max(seqs) <= 1,
        "ahead": ahead,
    }


def _waiting_alone(
    facts: Facts, waiting: list[LogEvent], casualties: list[tuple[LogEvent, str]] | None = None
) -> Match:
    """Only the waiting side: the ranks that timed out are the victims; the usual cause is one that never arrived.

    The waiting side includes how the waiters ended (SIGABRT exits, lost peers after the timeouts): with no
    timeout line at all, a worker that aborted is read the same way, with the abort as the only evidence.
    """
    casualties = casualties or []
    absent = sorted(
        {
            e.fields["rank"]
            for e in waiting
            if _ABSENTEES.search(event_kind(e)) and isinstance(e.fields.get("rank"), int)
        }
        | {r for e in waiting if _ABSENTEES.search(event_kind(e)) for r in named_ranks(e)}
    )
    w = _waits(facts, waiting)
    reporters, group, unheard = w.reporters, w.group, w.unheard
    idle = [] if absent else idle_ranks(facts, waiting)
    silent: list[int] = []
    if w.exact and group and reporters and not absent and not idle:
        silent = unheard if len(unheard) <= max(1, group // 4) else []
    absent = absent or idle
    culprit = Culprit(ranks=absent or silent)
    aborts = [e for e, why in casualties if why == "abort"]
    teardown = [e for e, why in casualties if why != "abort"]
    reading = _wait_reading(facts, waiting)
    conf = TIMEOUT_ALONE if waiting else ABORTED_ALONE
    if absent or silent:
        conf += 0.15
        if reading["short_timeout"]:
            conf -= 0.05  # a rank merely slower than a short timeout reads the same: less sure it never came
    # A timeout names the rank that waited: with no rank named as absent, the cause is not known yet (the words
    # still say what the usual cause is and how to confirm it).
    return Match(
        "conditional_collective" if absent or silent else "unknown",
        conf,
        culprit,
        [e.quote for e in waiting[:4]] + [e.quote for e in aborts[:2]] + [e.quote for e in teardown[:2]],
        {
            "category": "conditional_collective" if absent or silent else "unknown",
            "strength": "suggestive",
            "said": _said(waiting or aborts or teardown),
            "victims": reporters,
            "where": _where(culprit),
            "alone": True,
            "absent": absent,
            "idle": idle,
            "silent": silent,
            "unheard": unheard if not (absent or silent) and len(unheard) < (group or 0) else [],
            "group": group,
            "group_exact": w.exact,
            "ops": sorted({str(e.fields["op"]) for e in waiting if e.fields.get("op")}),
            "seqs": sorted({int(e.fields["seq"]) for e in waiting if isinstance(e.fields.get("seq"), int)}),
            "aborted": _abort_words(facts, aborts),
            "teardown": len(teardown),
            **reading,
        },
        status="hung" if waiting else "failed",
        template=PLAYBOOK,
    )


def idle_ranks(facts: Facts, waiting: list[LogEvent]) -> list[int]:
    """Ranks that did not wait while others timed out, whose own ProcessGroupNCCL counters say every collective
    they enqueued has completed (`last enqueued NCCL work: N, last completed NCCL work: N`, the dump-signal line each
    rank prints when one rank's watchdog fires): nothing of theirs is in flight, so they never issued the collective
    the others wait in (another code path, or busy or stuck outside collectives)."""
    waiters = {e.rank for e in waiting if e.rank is not None}
    seqs = [int(e.fields["seq"]) for e in waiting if isinstance(e.fields.get("seq"), int)]
    if not waiting:
        return []
    out: set[int] = set()
    for e in facts.ev.events:
        enq, done = e.fields.get("last_enqueued"), e.fields.get("last_completed")
        if e.rank is None or e.rank in waiters or not isinstance(enq, int) or not isinstance(done, int):
            continue
        if enq == done >= 0 and (not seqs or enq < max(seqs)):
            out.add(e.rank)
    return sorted(out)


def _abort_words(facts: Facts, aborts: list[LogEvent]) -> list[str]:
    """The aborted processes as the text names them: a rank, else a local rank, else a pid."""
    rank_of_pid = {e.pid: e.rank for e in facts.ev.events if e.pid is not None and e.rank is not None}
    out = []
    for e in aborts:
        pid = e.pid or e.fields.get("pid")
        rank = e.rank if e.rank is not None else rank_of_pid.get(pid)
        if rank is not None:
            who = f"rank {rank}"
        elif e.fields.get("local_rank") is not None:
            who = f"local rank {e.fields['local_rank']}"
        else:
            who = "the worker"
        if pid:
            who += f" (pid {pid})"
        if who not in out:
            out.append(who)
    return out[:4]
