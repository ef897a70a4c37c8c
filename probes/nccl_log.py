"""NCCL debug logs (NCCL_DEBUG=INFO/WARN/TRACE): collectives, communicator set-up, network errors.

Line formats are NCCL's own (src/debug.cc, checked against NVIDIA/nccl v2.18 .. v2.30):
    host:pid:tid [cudaDev] NCCL INFO <msg>
    host:pid:tid [cudaDev] file.cc:line NCCL WARN <msg>            (2.30 adds " (function)" after the line)
    host:pid:tid [cudaDev] 12.345 func:line NCCL TRACE <msg>
optionally after a `[2025-06-01 10:00:00] ` timestamp (WARN lines since 2.26), a torchrun `[rank3]:` prefix
or any launcher prefix such as Ray's `(RayTrainWorker pid=615, ip=...) `.
The collective line (`AllReduce: opCount 139d sendbuff ... [nranks=128] stream 0x...`) has kept one format
from 2.4 through 2.30 (src/enqueue.cc); AlltoAll/Gather/Scatter are newer op names in the same line.
A file that also holds PyTorch lines (tracebacks, watchdog timeouts) gets those read too: see `parse`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hangdx.probes.model import CollectiveRecord, Evidence, LogEvent, Quote, Source
from hangdx.probes.nccl_error import stage_of as _stage_of
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines as text_lines
from hangdx.probes.text import looks_binary, strip_rank_prefix

KIND = "nccl_log"
# A log with nothing of note in it is the usual case, not a file cut short: no gap for it.
QUIET_WHEN_EMPTY = True

_LINE = lazy(
    r"(?<![\w.\-])(?P<host>[A-Za-z0-9][\w.\-]*):(?P<pid>\d{1,10}):(?P<tid>\d{1,10}) \[(?P<dev>-?\d{1,6})\] "
    r"(?:\d+\.\d+ )?(?:(?:\S+:|\S+\.(?:h|hpp|c|cc|cu|cpp) )\d+ (?:\([^()]*\) )?)?"  # <= 2.3: `socket.h 398 `
    r"NCCL (?P<level>INFO|WARN|TRACE|CALL)\b ?(?P<msg>.*)$"
)
# NCCL 2.0-2.2 printed no `NCCL` word: `node1:54573:54696 [1] include/socket.h:194 WARN Call to recv failed : ...`
# (WARN after its source file and line), `node1:54573:54696 [1] INFO transport/net_ib.cu:537 -> 2`.
_LINE_OLD = lazy(
    r"(?<![\w.\-])(?P<host>[A-Za-z0-9][\w.\-]*):(?P<pid>\d{1,10}):(?P<tid>\d{1,10}) \[(?P<dev>-?\d{1,6})\] "
    r"(?:[\w./\-]{1,200}\.(?:h|hpp|c|cc|cu|cpp):\d{1,7} (?=WARN))?(?P<level>INFO|WARN) (?P<msg>\S.*)$"
)
# A warning quoted without its prefix, as people paste one line of a log: `NCCL WARN NET/IB : Got async event ...`
# (and `transport/net_ib.cc:1234 NCCL WARN ...`): read as NCCL's, from no known host or process.
_BARE = lazy(r"^(?:\S+\.cc:\d+ )?NCCL (?P<level>WARN) (?P<msg>\S.*)$")
# A log whose `host:pid:tid` was cut off, keeping the CUDA device: `[0] NCCL INFO Send: opCount 1 ...`.
_NO_HOST = lazy(r"^\[(?P<dev>-?\d{1,6})\] (?:\S+:\d+ )?NCCL (?P<level>INFO|WARN|TRACE) (?P<msg>\S.*)$")
_TIMESTAMP = lazy(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]")
_VERSION = lazy(r"NCCL version (\d{1,6})\.(\d{1,6})\.(\d{1,6})(\S*)")  # int() refuses 5000 digits
_COLL = lazy(
    r"^(?P<op>[A-Za-z]+): opCount (?P<opcount>[0-9a-fA-F]+) sendbuff (?P<send>\S+) recvbuff (?P<recv>\S+) "
    r"count (?P<count>\d{1,20}) datatype (?P<dtype>\d{1,9}) op (?P<redop>\d{1,9}) root (?P<root>-?\d{1,9}) "
    r"comm (?P<comm>0x[0-9a-fA-F]+|\(nil\)) \[nranks=(?P<nranks>\d{1,9})\](?: stream (?P<stream>\S+))?"
)
# 2.19+: one line per communicator with its shape.
_INIT_SHAPE = lazy(
    r"comm (?P<comm>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+) "
    r"localRanks (?P<local_ranks>\d+) localRank (?P<local_rank>\d+)(?: MNNVL (?P<mnnvl>\d+))?"
)
# Every version: "[ncclCommInitRank ]comm 0x.. rank 3 nranks 8 cudaDev 3 [nvmlDev 3 ]busId .. - Init COMPLETE"
# (commId, when printed, comes before "Init COMPLETE").
_INIT_DONE = lazy(
    r"(?:(?<!\w)(?P<func>nccl\w+) )?comm (?P<comm>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) "
    r"cudaDev (?P<cuda_dev>-?\d+)"
)
_COMM_ID = lazy(r"commId (0x[0-9a-fA-F]+)")
_NET_USING = lazy(r"^NET/(?P<transport>[\w/]+) ?: Using ?(?P<devices>.*)$")
_NET_NETWORK = lazy(r"^Using network (?P<transport>.*\S)\s*$")
_IFNAME = lazy(r"^(?P<var>NCCL_\w*IFNAME) set (?:by environment )?to (?P<value>\S+)")
# <= 2.18: "with error 12, opcode 0, len 0, vendor err 129 (Recv)"; 2.21-2.28: "with status=12 opcode=0 len=0
# vendor err 129 (Recv)"; 2.29+: "with status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_SEND(0) vendor_err=129".
_IB_COMPLETION = lazy(
    r"NET/IB(?:/GIN)? ?: Got completion from peer (?P<peer>\S+) with "
    r"(?:error (?P<err_old>\d+), opcode (?P<op_old>\d+), len (?P<len_old>\d+), vendor err (?P<vendor_old>\d+)"
    r"|status=(?:(?P<status_name>[A-Z_]+)\()?(?P<err>\d+)\)? opcode=(?:(?P<op_name>[A-Z_]+)\()?(?P<op>\d+)\)?"
    r"(?: len=(?P<len>\d+))?(?: vendor err |\s*vendor_err=)(?P<vendor>\d+))"
    r"(?: \((?P<dir>\w+)\))?"
)
_HCA = lazy(r"\bhca (\S+)")
_LOCAL_GID = lazy(r"localGid (\S+)")
_REMOTE_GID = lazy(r"remoteGids? ?(\S+)")
# "NET/IB : Got async event : port error" (<= 2.19), "NET/IB : mlx5_0:1 Got async event : port error" (2.21),
# "... Got async error event: port error" (2.23-2.28), "... Got non-fatal async event: port error(10)" (2.29+),
# "... async fatal event on QP (0x..): ..." and "... GID table changed".
_IB_ASYNC = lazy(
    r"NET/IB ?: (?:(?P<dev>[\w.\-]+):(?P<port>\d+) )?"
    r"(?:Got (?:non-fatal |)async (?:error )?event ?: ?(?P<event>.*\S)"
    r"|async fatal event on (?P<fatal_on>QP|SRQ)\b.*: (?P<fatal_event>[^:]+)$"
    r"|(?P<gid>GID table changed))"
)
_EVENT_CODE = lazy(r"\((\d+)\)$")
# (Every group stops at a comma or the line's end: a lazy `.+?` before `\s*$` is quadratic on long lines.)
_CONNECT_FAIL = lazy(
    r"(?:[Cc]onnect to (?P<peer>\S+) (?:failed : |returned )(?P<err>[^,]+)(?:, retrying.*|, exceeded.*)?$"
    r"|Call to connect returned (?P<err2>[^,]{1,200}), retrying"
    r"|Connection closed by remote peer (?P<peer3>\S+)"
    r"|Call to (?:recv from|send to) (?P<peer4>\S+) failed : (?P<err4>.*\S)"
    r"|Call to (?:connect|recv|send|read|write)\w{0,8} failed ?: (?P<err5>[^.]*[^.\s]))"  # <= 2.3: no peer named
)
_TIMEOUT = lazy(r"exceeded timeouts|timed out|[Tt]imeout", re.I)

_DTYPES = {
    0: "int8",
    1: "uint8",
    2: "int32",
    3: "uint32",
    4: "int64",
    5: "uint64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "bfloat16",
    10: "float8e4m3",
    11: "float8e5m2",
}
# ibv_wc_status (infiniband/verbs.h) and what ibv_wc_status_str() prints for it.
_WC_STATUS = {
    0: ("IBV_WC_SUCCESS", "success"),
    1: ("IBV_WC_LOC_LEN_ERR", "local length error"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error"),
    3: ("IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error"),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error"),
    5: ("IBV_WC_WR_FLUSH_ERR", "Work Request Flushed Error"),
    6: ("IBV_WC_MW_BIND_ERR", "memory management operation error"),
    7: ("IBV_WC_BAD_RESP_ERR", "bad response error"),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error"),
    9: ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request error"),
    10: ("IBV_WC_REM_ACCESS_ERR", "remote access error"),
    11: ("IBV_WC_REM_OP_ERR", "remote operation error"),
    12: ("IBV_WC_RETRY_EXC_ERR", "transport retry counter exceeded"),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "RNR retry counter exceeded"),
    14: ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation error"),
    15: ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request"),
    16: ("IBV_WC_REM_ABORT_ERR", "aborted error"),
    17: ("IBV_WC_INV_EECN_ERR", "invalid EE context number"),
    18: ("IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state"),
    19: ("IBV_WC_FATAL_ERR", "fatal error"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout error"),
    21: ("IBV_WC_GENERAL_ERR", "general error"),
}


@dataclass
class NcclLine:
    """One line carrying NCCL's `host:pid:tid [dev] NCCL LEVEL` prefix."""

    lineno: int
    text: str  # the verbatim line
    host: str  # "" when the line came without NCCL's prefix (a warning quoted on its own)
    pid: int | None
    tid: int | None
    cuda_dev: int
    level: str
    msg: str
    rank_prefix: int | None = None
    timestamp: str | None = None


def match_line(line: str) -> NcclLine | None:
    """Parse NCCL's line prefix, wherever it sits in the line; None when it is not an NCCL line."""
    rank, rest = strip_rank_prefix(line)
    m = _LINE.search(rest)
    if m is None and ("INFO " in rest or "WARN " in rest):
        m = _LINE_OLD.search(rest)
    if not m:
        b = _BARE.match(rest.strip()) or _NO_HOST.match(rest.strip())
        if b is None:
            return None
        dev = int(b["dev"]) if "dev" in b.groupdict() else -1
        return NcclLine(0, line, "", None, None, dev, b["level"], b["msg"].rstrip(), rank_prefix=rank)
    ts = _TIMESTAMP.match(rest)
    return NcclLine(
        lineno=0,
        text=line,
        host=m["host"],
        pid=int(m["pid"]),
        tid=int(m["tid"]),
        cuda_dev=int(m["dev"]),
        level=m["level"],
        msg=m["msg"].rstrip(),
        rank_prefix=rank,
        timestamp=ts.group(1) if ts else None,
    )


def count_lines(head: bytes) -> int:
    """How many NCCL-prefixed lines the bytes hold."""
    return sum(1 for ln in head.decode("utf-8", errors="replace").splitlines() if _LINE.search(ln))


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    n = count_lines(head)
    if n == 0:
        return 0
    from hangdx.probes import torch_log  # here, not at the top: torch_log imports this module

    base = 60 + min(n, 30) if n >= 3 else 20
    # A torchrun stderr with NCCL_DEBUG=INFO holds both; the file goes to whichever content dominates
    # (both parsers read both kinds of line, so nothing is lost either way).
    if torch_log.torch_weight(head) > n:
        return min(base, 30)
    return base


@dataclass
class _State:
    versions: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # pid -> version
    version_text: dict[int, str] = field(default_factory=dict)  # pid -> "2.27.3+cuda12.9"
    file_version: tuple[int, int, int] | None = None
    events: list[LogEvent] = field(default_factory=list)
    comms: dict[tuple[int, str], dict] = field(default_factory=dict)  # (pid, comm) -> init facts
    colls: list[tuple[NcclLine, re.Match]] = field(default_factory=list)


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    """Read NCCL lines as NCCL, and every other line as PyTorch/torchrun output (mixed files are common)."""
    if not data or looks_binary(data[:8192]):
        return
    from hangdx.probes import torch_log

    nccl, other = split_lines(text_lines(data))
    parse_nccl_lines(nccl, src, ev, file_version=version_of(other))
    torch_log.parse_torch_lines(other, src, ev)


def parse_lines(lines: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py): NCCL lines as NCCL, the rest as PyTorch/torchrun."""
    from hangdx.probes import torch_log

    nccl, other = split_numbered(lines)
    parse_nccl_lines(nccl, src, ev, file_version=version_of(other))
    torch_log.parse_torch_lines(other, src, ev)


# Lines claims() parsed, by text, for split_numbered to take rather than parse again (the reader claims every kept
# line, then parses the regions): each is taken once, so a line met twice is parsed again the second time.
_CLAIMED: dict[str, NcclLine] = {}
_CLAIMED_MAX = 8192


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("NCCL ",)
CLAIM_PATTERNS: tuple[str, ...] = (  # NCCL 2.0-2.2's prefix, with no `NCCL` word (_LINE_OLD)
    r":\d{1,10}:\d{1,10} \[-?\d{1,6}\] (?:[\w./\-]{1,200}\.(?:h|hpp|c|cc|cu|cpp):\d{1,7} )?(?:INFO|WARN) ",
)


def claims(line: str) -> int:
    """How surely one line is NCCL's own (see probes/reader.py)."""
    if "NCCL " in line or "INFO " in line or "WARN " in line:
        nl = match_line(line)
        if nl is not None:
            if len(_CLAIMED) >= _CLAIMED_MAX:
                _CLAIMED.clear()
            _CLAIMED[line] = nl
            return 8
    if line.startswith("NCCL version ") and _VERSION.match(line):
        return 6
    return 0


def version_of(other: list[tuple[int, str]]) -> tuple[int, int, int] | None:
    """The NCCL version from a bare `NCCL version 2.27.3+cuda12.9` line (NCCL_DEBUG=VERSION/WARN print it so)."""
    for item in other:
        ln = item[1]
        m = _VERSION.match(strip_rank_prefix(ln)[1].strip())
        if m:
            return (int(m[1]), int(m[2]), int(m[3]))
    return None


def split_lines(all_lines: list[str]) -> tuple[list[NcclLine], list[tuple[int, str]]]:
    """NCCL lines (parsed) and the rest (1-based line number, text)."""
    return split_numbered(list(enumerate(all_lines, 1)))


def split_numbered(numbered: list[tuple[int, str]]) -> tuple[list[NcclLine], list[tuple[int, str]]]:
    """NCCL lines (parsed) and the rest, of (line number, text) pairs."""
    nccl: list[NcclLine] = []
    other: list[tuple[int, str]] = []
    for item in numbered:
        i, ln = item[0], item[1]
        maybe = "NCCL " in ln or " INFO " in ln or " WARN " in ln  # NCCL 2.0-2.2 printed no `NCCL` word
        nl = (_CLAIMED.pop(ln, None) or match_line(ln)) if maybe else None
        if nl:
            nl.lineno = i
            if nl.rank_prefix is None and len(item) > 2:  # the reader took the prefix off and kept its rank
                nl.rank_prefix = item[2]  # type: ignore[misc]
            nccl.append(nl)
        else:
            other.append(item)
    return nccl, other


def parse_nccl_lines(
    nccl: list[NcclLine], src: Source, ev: Evidence, file_version: tuple[int, int, int] | None = None
) -> None:
    st = _State(file_version=file_version)
    first_event = len(ev.events)
    for nl in nccl:
        try:
            _one(nl, src, ev, st)
        except (ValueError, IndexError, KeyError):  # a mangled line is skipped, never fatal
            continue
        ev.note_host(nl.host)
    _finish_collectives(st, src, ev)
    _setup_tail(nccl, src, ev, first_event)
    _fill_ranks(st, ev.events[first_event:])
    _mark_stages(nccl, ev.events[first_event:])


# Lines NCCL prints when a communicator goes down (ncclCommDestroy / ncclCommAbort, the proxy's service thread
# seeing a local rank leave): past set-up, whatever came before.
_TEARDOWN = lazy(
    r"Destroy COMPLETE|Abort COMPLETE|\[Service thread\]|ncclComm(?:Destroy|Abort|Finalize)|[Ff]inaliz"
)


def _setup_tail(nccl: list[NcclLine], src: Source, ev: Evidence, first_event: int) -> None:
    """Where NCCL's lines stop inside communicator set-up (every NCCL line is set-up INFO: bootstrap, network and
    topology choice, channels and their connections; no `Init COMPLETE`, no collective, no warning, no error's
    return trace, no teardown), its last line becomes an `nccl_setup` event (unless it already made one), so that
    what reads where each process stopped sees it (playbooks/timeline.py, stopped_at_stage)."""
    if not nccl or any(nl.level != "INFO" for nl in nccl):
        return
    for nl in nccl:
        if (
            "Init COMPLETE" in nl.msg
            or _COLL.match(nl.msg)
            or _TEARDOWN.search(nl.msg)
            or _TRACE.match(nl.msg)
        ):
            return  # past set-up, or an error's return trace (`enqueue.cc:1960 -> 5`): the failure speaks
    last = nccl[-1]
    if any(e.quote.line == last.lineno for e in ev.events[first_event:]):
        return
    _event("nccl_setup", last, src, ev, message=last.msg[:300])


# Where a failure happened, from the failing line and NCCL's error trace after it (`init.cc:1234 -> 2`, `proxy.cc:614
# -> 2 [Proxy Thread]`): set-up (bootstrap, communicator init, socket creation) or the data path (the proxy thread
# moving a collective's bytes). Either decides; with neither, a process that already finished `Init COMPLETE` or
# issued collectives is past set-up.
_TRACE = lazy(r"^(?:\S+:\d+ )?\S+:\d+ ?-> ?\d+")  # NCCL's error return trace: `file.cc:123 -> 2`
_STAGED = ("nccl_conn_refused", "nccl_warn", "nccl_timeout")
_CONNECTING = lazy(r"[Cc]onnect(?:ion)? to|Call to connect")


def _mark_stages(nccl: list[NcclLine], events: list[LogEvent]) -> None:
    """Give each failure event `stage`: "init" or "data" when its line or the trace after it says (see above)."""
    at = {nl.lineno: i for i, nl in enumerate(nccl)}
    set_up: dict[tuple, int] = {}  # process -> index of its first `Init COMPLETE` or collective line
    for i, nl in enumerate(nccl):
        if (nl.host, nl.pid) not in set_up and ("Init COMPLETE" in nl.msg or _COLL.match(nl.msg)):
            set_up[(nl.host, nl.pid)] = i
    for e in events:
        i = at.get(e.quote.line)
        if e.kind not in _STAGED or i is None:
            continue
        nl = nccl[i]
        stage = _stage_of(nl.msg)
        proc = (nl.host, nl.pid)
        seen = 0
        for later in nccl[i + 1 : i + 200]:  # its trace: the next lines of the same process
            if stage or seen >= 20:
                break
            if (later.host, later.pid) != proc:
                continue
            seen += 1
            if later.level == "WARN" and not _TRACE.match(later.msg) and not _stage_of(later.msg):
                break  # the next failure: its own trace follows it
            stage = _stage_of(later.msg)
        if stage is None and not _CONNECTING.search(nl.msg) and set_up.get(proc, i) < i:
            stage = "data"  # a failed connect may be a late set-up; a failed send or receive is not
        if stage:
            e.fields["stage"] = stage


def _fill_ranks(st: _State, events: list[LogEvent]) -> None:
    """A line without a rank (an IB error, a WARN) belongs to its process: use the rank in its widest comm."""
    widest: dict[int, tuple[int, int]] = {}  # pid -> (nranks, rank)
    for (pid, _comm), facts in st.comms.items():
        if "rank" in facts and facts.get("nranks", 0) > widest.get(pid, (-1, 0))[0]:
            widest[pid] = (facts.get("nranks", 0), facts["rank"])
    for e in events:
        if e.rank is None and e.pid in widest:
            e.rank = widest[e.pid][1]


def _quote(src: Source, nl: NcclLine) -> Quote:
    return Quote(source=src.name, line=nl.lineno, text=nl.text)


def _event(kind: str, nl: NcclLine, src: Source, ev: Evidence, rank: int | None = None, **fields) -> None:
    fields.setdefault("cuda_dev", nl.cuda_dev)
    if nl.timestamp:
        fields.setdefault("timestamp", nl.timestamp)
    ev.events.append(
        LogEvent(
            kind=kind,
            quote=_quote(src, nl),
            host=nl.host or src.host,
            rank=rank if rank is not None else (nl.rank_prefix if nl.rank_prefix is not None else src.rank),
            pid=nl.pid,
            fields=fields,
        )
    )


def _one(nl: NcclLine, src: Source, ev: Evidence, st: _State) -> None:
    msg = nl.msg
    if nl.level in ("INFO", "TRACE"):
        m = _COLL.match(msg)
        if m:
            st.colls.append((nl, m))
            return
        m = _VERSION.search(msg)
        if m and msg.startswith("NCCL version"):
            ver = (int(m[1]), int(m[2]), int(m[3]))
            st.versions[nl.pid] = ver
            st.version_text[nl.pid] = f"{m[1]}.{m[2]}.{m[3]}{m[4]}"
            _event("nccl_init", nl, src, ev, version=st.version_text[nl.pid])
            return
        if _init_line(nl, src, ev, st):
            return
        if _net_line(nl, src, ev):
            return
        m = _CONNECT_FAIL.search(msg)
        if m:
            _conn_event(nl, m, src, ev)
        return
    if nl.level != "WARN":
        return
    m = _IB_COMPLETION.search(msg)
    if m:
        _ib_completion(nl, m, src, ev)
        return
    m = _IB_ASYNC.search(msg)
    if m:
        event = m["event"] or m["fatal_event"] or ("GID table change" if m["gid"] else "")
        code = _EVENT_CODE.search(event) if m["event"] else None
        event = event[: code.start()] if code else event
        _event(
            "nccl_port_error",
            nl,
            src,
            ev,
            hca=m["dev"],  # named as the catalogue's rows for the same line name it
            port=int(m["port"]) if m["port"] else None,
            event=event.strip(),
            event_code=int(code.group(1)) if code else None,
            fatal=bool(m["fatal_on"]),
        )
        return
    m = _CONNECT_FAIL.search(msg)
    if m:
        _conn_event(nl, m, src, ev)
        return
    if _TIMEOUT.search(msg):
        _event("nccl_timeout", nl, src, ev, message=msg)
        return
    _event("nccl_warn", nl, src, ev, message=msg)


def _init_line(nl: NcclLine, src: Source, ev: Evidence, st: _State) -> bool:
    m = _INIT_SHAPE.search(nl.msg)
    if m:
        facts = st.comms.setdefault((nl.pid, m["comm"]), {})
        facts.update(
            rank=int(m["rank"]),
            nranks=int(m["nranks"]),
            nnodes=int(m["nnodes"]),
            local_ranks=int(m["local_ranks"]),
            local_rank=int(m["local_rank"]),
        )
        _init_event(nl, src, ev, st, m["comm"], facts)
        return True
    m = _INIT_DONE.search(nl.msg) if "Init COMPLETE" in nl.msg else None
    done = nl.msg.rfind("Init COMPLETE", m.end()) if m else -1
    if m and done >= 0:
        facts = st.comms.setdefault((nl.pid, m["comm"]), {})
        facts.update(rank=int(m["rank"]), nranks=int(m["nranks"]), cuda_dev=int(m["cuda_dev"]))
        comm_id = _COMM_ID.search(nl.msg, m.end(), done)
        if comm_id:
            facts["comm_id"] = comm_id.group(1)
        _init_event(nl, src, ev, st, m["comm"], facts, complete=True)
        return True
    return False


def _init_event(nl: NcclLine, src, ev, st: _State, comm: str, facts: dict, complete: bool = False) -> None:
    ver = st.versions.get(nl.pid) or st.file_version
    _event(
        "nccl_init",
        nl,
        src,
        ev,
        rank=facts.get("rank"),
        version=st.version_text.get(nl.pid) or (".".join(map(str, ver)) if ver else None),
        comm=comm,
        nranks=facts.get("nranks"),
        nnodes=facts.get("nnodes"),
        local_rank=facts.get("local_rank"),
        cuda_dev=facts.get("cuda_dev", nl.cuda_dev),
        comm_id=facts.get("comm_id"),
        complete=complete,
    )


def _net_line(nl: NcclLine, src: Source, ev: Evidence) -> bool:
    msg = nl.msg
    m = _NET_USING.match(msg)
    if m:
        _event("nccl_net", nl, src, ev, transport=m["transport"], devices=m["devices"].strip())
        return True
    m = _NET_NETWORK.match(msg)
    if m:
        _event("nccl_net", nl, src, ev, transport=m["transport"], devices=None)
        return True
    m = _IFNAME.match(msg)
    if m:
        _event("nccl_net", nl, src, ev, transport=None, devices=m["value"], setting=m["var"])
        return True
    return False


def _ib_completion(nl: NcclLine, m: re.Match, src: Source, ev: Evidence) -> None:
    code = int(m["err"] if m["err"] is not None else m["err_old"])
    name, text = _WC_STATUS.get(code, (None, None))
    status = m["status_name"] or name
    hca = _HCA.search(nl.msg)
    lgid, rgid = _LOCAL_GID.search(nl.msg), _REMOTE_GID.search(nl.msg)
    opcode = m["op"] if m["op"] is not None else m["op_old"]
    length = m["len"] if m["len"] is not None else m["len_old"]
    _event(
        "nccl_ib_completion_error",
        nl,
        src,
        ev,
        peer=m["peer"],
        error=code,
        status=status,
        status_text=text,
        opcode=int(opcode),
        opcode_name=m["op_name"],
        len=int(length) if length is not None else None,
        vendor_err=int(m["vendor"] if m["vendor"] is not None else m["vendor_old"]),
        direction=m["dir"],
        hca=hca.group(1) if hca else None,
        local_gid=lgid.group(1) if lgid else None,
        remote_gid=rgid.group(1) if rgid else None,
        qp=None,  # NCCL does not print the QP number in this line
    )


def _conn_event(nl: NcclLine, m: re.Match, src: Source, ev: Evidence) -> None:
    peer = m["peer"] or m["peer3"] or m["peer4"]
    err = m["err"] or m["err2"] or m["err4"] or m["err5"]
    err = err or ("Connection closed by remote peer" if m["peer3"] else None)
    err = err.strip() if err else err
    _event("nccl_conn_refused", nl, src, ev, peer=peer, error=err, retrying="retrying" in nl.msg)


def _finish_collectives(st: _State, src: Source, ev: Evidence) -> None:
    """Turn collective lines into records once every init line (rank, nNodes, version) is known."""
    # NCCL only advances opCount in ncclProxyStart, so a communicator without proxy work (single node)
    # prints opCount 0 forever: such a 0 is "unknown", not "stuck at the first op".
    counts: dict[tuple[int, str], list[int]] = {}
    for nl, m in st.colls:
        counts.setdefault((nl.pid, m["comm"]), []).append(int(m["opcount"], 16))
    for nl, m in st.colls:
        key = (nl.pid, m["comm"])
        facts = st.comms.get(key, {})
        ver = st.versions.get(nl.pid) or st.file_version
        seq: int | None = int(m["opcount"], 16)
        single_node = facts.get("nnodes") == 1
        seen = counts[key]
        if (ver and ver >= (2, 27, 0) and single_node) or (len(seen) >= 3 and not any(seen)):
            seq = None
        rank = facts.get("rank")
        if rank is None:
            rank = nl.rank_prefix if nl.rank_prefix is not None else src.rank
        dtype = int(m["dtype"])
        ev.collectives.append(
            CollectiveRecord(
                rank=rank,
                op=m["op"].lower(),
                seq=seq,
                pg=m["comm"],
                state="scheduled",  # NCCL logs the call when it is enqueued, not when it runs
                numel_in=int(m["count"]),
                dtype=_DTYPES.get(dtype, f"nccl_dtype_{dtype}"),
                sizes={"root": int(m["root"]), "nranks": int(m["nranks"]), "redop": int(m["redop"])},
                host=nl.host or src.host,
                quote=_quote(src, nl),
                origin="nccl_log",
                pid=nl.pid,
                device=nl.cuda_dev,
            )
        )
