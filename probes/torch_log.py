"""PyTorch / torchrun stderr and per-rank logs: watchdog timeouts, desync reports, gloo errors, tracebacks.

Formats come from real output: the gloo, DDP, monitored-barrier, collective-mismatch and torchrun ones were
recorded on torch 2.13 (tests/fixtures/torch_log/make_fixtures.py); the NCCL watchdog, desync report and CUDA
OOM ones from pytorch sources (ProcessGroupNCCL.cpp, TraceUtils.h) and logs quoted in public GitHub issues.
Lines may carry torchrun's `[rank3]:` prefix and c10's `[E1122 01:48:50.682679688 File.cpp:123] ` header.

Sniff rule for files that mix NCCL_DEBUG lines and PyTorch lines: the kind whose lines dominate wins
(NCCL lines counted one each; PyTorch telltales ten, tracebacks three, `[rankN]:` lines one each).
Either parser reads both kinds of line, so the choice only names the file.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from typing import Any

from hangdx.probes import counters, nccl_log
from hangdx.probes.model import CollectiveRecord, Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines as text_lines
from hangdx.probes.text import looks_binary, strip_rank_prefix

KIND = "torch_log"
# A log with nothing of note in it is the usual case, not a file cut short: no gap for it.
QUIET_WHEN_EMPTY = True

# c10 / glog headers: "[E1122 01:48:50.682679688 ProcessGroupGloo.cpp:2901] ", "[E ProcessGroupNCCL.cpp:458] ",
# and torchrun's "E1122 01:48:41.280000 8238 site-packages/torch/.../api.py:1002] ".
_LOG_HEADER = lazy(
    r"^\[?[EWIF](?:\d{4} \d\d:\d\d:\d\d\.\d+(?: \d+)?)? ?[^\s\]]+:\d+\] ?",
)
# "[Rank 3]", "[PG 1 Rank 0]", "[PG 0 (default_pg) Rank 12]", "[PG ID 0 PG GUID 0(default_pg) Rank 1]".
_PG_RANK = lazy(
    r"\[(?:PG (?:ID )?(?P<pgid>\d+)(?: PG GUID (?P<guid>[^\s(\]]+))? ?(?:\((?P<pgname>[^()\[\]]*)\))? )?Rank (?P<rank>\d+)\]"
)
# "Watchdog caught collective operation timeout: WorkNCCL(<args>) ran for <ms> milliseconds": the head is
# found first, then the first end after it (one lazy regex over both is quadratic on a long line).
_WATCHDOG_HEAD = "Watchdog caught collective operation timeout: WorkNCCL("
_WATCHDOG_END = lazy(r"\) ran for (\d+) milliseconds")
_WORK_ARG = lazy(r"(?<!\w)(\w+(?:\(ms\))?)=([^,)]+)")
# `last enqueued NCCL work: N` (watchdog, periodic update) and `Last enqueued NCCL work: N` (the dump-signal line every
# rank prints when one rank's watchdog fires: getNCCLWatchdogTimeoutErrorMsg).
_LAST_ENQ = lazy(r"[Ll]ast enqueued (?:NCCL )?work: (\d+)")
_LAST_DONE = lazy(r"last completed (?:NCCL )?work: (\d+)")
_LAST_START = lazy(r"last started (?:NCCL )?work: (\d+)")
_AT_WORK = lazy(r"(?:at (?:NCCL )?work|work sequence id): (\d+)")
_DESYNC_HEAD = lazy(r"\[(\d+)\] Timeout at collective: (\S+?), #(\d+)")
_DESYNC_NOT_FINISHED = lazy(r"\[([\d, ]+)\] joined but didn't finish collective #(\d+)")
_DESYNC_NOT_JOINED = lazy(r"\[([\d, ]+)\] finished collective #(\d+), but didn't join collective #(\d+)")
_DESYNC_NEVER = lazy(r"ranks \[([\d, ]+)\] are the lagging ranks")
_DESYNC_SNAP_SEQ = lazy(r"^#(\d+) (started|finished) ranks:")
_DESYNC_SNAP = lazy(r"^\[([\d, ]+)\] (started|finished) (\S+)")
_MISMATCH = "Detected mismatch between collectives on ranks"
_FINGERPRINT = lazy(r"Rank (\d+) is running (?:inconsistent )?collective: CollectiveFingerPrint\(")
_FP_ARG = lazy(r"(SequenceNumber|OpType|TensorShape|TensorDtypes|TensorDeviceTypes)=")
_MONITORED = lazy(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms")
_REPORTER = lazy(r"\[Rank (\d+)\]")
_GLOO_TIMEOUT = lazy(r"Timed out waiting (\d+)ms for (\w+) operation to complete")
_GLOO_SIZE = lazy(r"(?:(?<!\d)(\d+) vs (\d+)\. )?Received data size doesn't match expected size")
_CONN_CLOSED = lazy(r"Connection closed by peer \[([^\[\]]+)\]:(\d+)")
_CONN_ERROR = lazy(r"(Read|Write) error \[([^\]]+)\]:(\d+): (Connection reset by peer|Broken pipe)")
_CONN_GENERIC = lazy(r"Connection reset by peer|Broken pipe")
_DDP_EXPECTED = "Expected to have finished reduction in the prior iteration"
_DDP_INDICES = lazy(r"Parameter indices which did not receive grad for rank (\d+): ?(.*)$")
_DDP_NAMES = lazy(r"Parameters which did not receive grad for rank (\d+): ?(.*)$")
_TR_ENTRY = lazy(r"^\[(\d+)\]:\s*$")
_TR_FIELD = lazy(r"^\s+(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_PROC_FAILED = lazy(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)(?: of binary: (.*))?")
_PROC_SIGNAL = lazy(r"Sending process (\d+) closing signal (SIG\w+)")
_OOM = lazy(r"CUDA out of memory\. Tried to allocate ([\d.]+ ?[KMGTP]?i?B)")
_OOM_GPU = lazy(r"GPU (\d+)")
_OOM_TOTAL = lazy(r"total capacity of ([\d.]+ ?[KMGTP]?i?B) of which ([\d.]+ ?[KMGTP]?i?B|0 bytes) is free")
_OOM_TOTAL_OLD = lazy(r"(?<![\d.])([\d.]+ ?[KMGTP]?i?B) total capacity;")
_OOM_FREE_OLD = lazy(r"(?<![\d.])([\d.]+ ?[KMGTP]?i?B) free")
_EXC_LINE = lazy(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
# A traceback's frame line (the first of a pasted fragment may have lost its indentation).
_FRAME = lazy(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.*\S)\s*$')
# IPython / Jupyter's traceback: a header `KeyboardInterrupt    Traceback (most recent call last)`, then per frame
# `/path/file.py in func(args)` (or `<ipython-input-5-...> in <module>`) and its source with the current line
# marked `--> 435`; the exception line `KeyboardInterrupt: ` ends it.
_IPY_HEAD = lazy(r"^(?P<type>[A-Za-z_][\w.]{0,200})\s{2,}Traceback \(most recent call last\)\s*$")
_IPY_FRAME = lazy(
    r"^(?:File )?(?P<file>\S{1,1000}?\.py|<ipython-input-[^>]{1,200}>|Cell In\[\d{1,9}\])(?:[:,] line \d{1,9})?,? in (?P<func>[\w<>.]{1,200})(?:\(.{0,2000}\))?\s*$"
)
_IPY_ARROW = lazy(r"^-{1,8}> ?(?P<line>\d{1,9})\b")
_SIGNAL_NAME = lazy(r"\((SIG[A-Z0-9]+)\)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "KB": 1000, "MB": 10**6}
_UNITS.update({"GB": 10**9, "TB": 10**12})
# c10's log header naming a process-group source file: "[E1122 ... ProcessGroupGloo.cpp:2901]" (a py-spy
# native frame prints "(ProcessGroupNCCL.cpp:1234)", which must not count).
_PG_HEADER = lazy(r"ProcessGroup\w{1,40}\.cpp:\d+\]")  # bounded: linear on a long word

# c10's `[E1122 01:48:50.682679688 File.cpp:123] ` and torchrun's `E1122 01:48:41.280000 8238 x/api.py:1002] `.
# c10's logger: `[I1122 01:40:12.000000 123 socket.cpp:752] ` with glog, `[I socket.cpp:580] ` (no time) without it.
_C10_HEADER = lazy(
    r"\[?[EWIF](?:\d{4} \d\d:\d\d:\d\d\.\d+(?: \d+)? ?[^\s\]]+| [\w.\-/]{1,120}\.(?:cpp|cc|c|h|hpp|cu)):\d+\] "
)
# The last line of a Python traceback: `torch.OutOfMemoryError: ...`, `RuntimeError: NCCL error ...`.
_EXC_HINT = lazy(r"(?:Error|Exception|Interrupt|Exit)$")

# Lines only PyTorch or torchrun print; each counts ten towards the sniff weight.
_TELLTALES = (
    "Watchdog caught collective operation timeout",
    "last enqueued NCCL work",
    "last enqueued work:",
    "Timeout at collective:",
    "lagging/dead/mismatched ranks",
    _MISMATCH,
    "failed to pass monitoredBarrier",
    "for recv operation to complete",
    "for send operation to complete",
    "Received data size doesn't match expected size",
    "Connection closed by peer [",
    "did not receive grad for rank",
    _DDP_EXPECTED,
    "Root Cause (first observed failure)",
    "torch.distributed.elastic",
    "ChildFailedError",
    "closing signal SIG",
    "CUDA out of memory",
    "CUDA error: ",
    "RendezvousConnectionError",
    "RendezvousTimeoutError",
    "DistStoreError",
    "client socket has timed out",
    "DistNetworkError",
    "client socket has failed to connect",
    "DataLoader worker (pid",
    "encountered in worker. This might be caused by insufficient shared memory",
    "Setting OMP_NUM_THREADS environment variable for each process",
)


def torch_weight(head: bytes) -> int:
    """How much of the bytes is PyTorch/torchrun output (see the module docstring)."""
    w = 0
    for ln in head.decode("utf-8", errors="replace").splitlines():
        if any(t in ln for t in _TELLTALES) or _PG_HEADER.search(ln):
            w += 10
        elif "Traceback (most recent call last):" in ln:
            w += 3
        elif ln.startswith(("[rank", "[default")) and strip_rank_prefix(ln)[0] is not None:
            if "NCCL " not in ln or nccl_log.match_line(ln) is None:
                w += 1
    return w


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    w = torch_weight(head)
    if w == 0:
        return 0
    text = head.decode("utf-8", errors="replace")
    if any(t in text for t in _TELLTALES) or _PG_HEADER.search(text):
        base = 70 + min(w // 10, 20)
    elif w >= 5 and "Traceback (most recent call last):" not in text:
        base = 50  # many `[rankN]:` lines, nothing else
    elif "Traceback (most recent call last):" in text:
        base = 20 if w < 10 else 45  # a plain Python traceback from a rank's log
    else:
        base = 10
    n = nccl_log.count_lines(head)
    if n and n >= w:
        return min(base, 19)  # an NCCL log with a few PyTorch lines: nccl_log's to name
    if n:
        return max(base, 40)  # PyTorch dominates; stay above nccl_log's capped score
    return base


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    """Read PyTorch/torchrun lines, and any NCCL_DEBUG lines among them as NCCL (see nccl_log)."""
    if not data or looks_binary(data[:8192]):
        return
    nccl, other = nccl_log.split_lines(text_lines(data))
    if nccl:
        nccl_log.parse_nccl_lines(nccl, src, ev, file_version=nccl_log.version_of(other))
    parse_torch_lines(other, src, ev)


def parse_lines(lines: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py); the same reading as nccl_log.parse_lines."""
    nccl_log.parse_lines(lines, src, ev)


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (
    "Traceback (most recent call last)",
    *_TELLTALES,
    "ProcessGroup",
    "%|",
    "Error",
    "Exception",
    "Interrupt",
    "Exit",
    ",",
    " | ",
    *counters.LENGTH_WORDS,
)
CLAIM_PATTERNS: tuple[str, ...] = (r"^\[?[EWIF]", r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):")


def claims(line: str) -> int:
    """How surely one line is PyTorch's or torchrun's own (see probes/reader.py)."""
    if "Traceback (most recent call last)" in line:
        return 7
    if any(t in line for t in _TELLTALES) or _PG_HEADER.search(line):
        return 8
    if _C10_HEADER.match(line):
        return 6
    if "%|" in line and ("it/s" in line or "s/it" in line or _BAR_RATE.search(line)):
        return 5  # the cheap test first: the rate's search is slow on a long line
    if _EXC_LINE.match(line) and _EXC_HINT.search(line.split(":", 1)[0]):
        return 5
    if counters.is_python_log(line):
        return 5  # a line of the program's own Python logging: a rank's log
    if counters.length(line) is not None:
        return 5  # a rank's count of the batches it will run (`Rank = 2, Number of batches 8`)
    return 0


def _ranks(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text) if len(x) <= 9]  # int() of 5000 digits raises


def _op_name(raw: str) -> str:
    """WorkNCCL OpType to the evidence model's op: ALLREDUCE -> allreduce, _ALLGATHER_BASE -> allgather."""
    op = raw.strip().lower().lstrip("_")
    for suffix in ("_base", "_coalesced"):
        if op.endswith(suffix) and op != suffix.lstrip("_"):
            op = op[: -len(suffix)]
    return op.replace("_", "")


def _bytes(size: str) -> int | None:
    m = re.match(r"([\d.]+) ?([KMGTP]?i?B)", size)
    if not m or m.group(2) not in _UNITS:
        return None
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    except (ValueError, OverflowError):  # "1.2.3 GiB"; 5000 digits are an infinite float
        return None


@dataclass
class _Line:
    lineno: int
    text: str  # verbatim
    rank: int | None  # from the `[rankN]:` prefix
    body: str  # without the rank prefix
    msg: str  # without the rank prefix and the log header


@dataclass
class _State:
    src: Source
    ev: Evidence
    tb: dict[int | None, dict] = field(default_factory=dict)  # per rank prefix: open traceback
    last_exc: dict[int | None, LogEvent] = field(default_factory=dict)  # per rank: exception still reading
    desync: dict | None = None
    monitored: dict[int | None, dict] = field(default_factory=dict)
    ddp: dict[int | None, dict] = field(default_factory=dict)
    torchrun: dict | None = None  # the failure-summary entry being read
    root_cause: bool = False
    watchdogs: dict[tuple, LogEvent] = field(default_factory=dict)
    progress: dict[tuple, dict] = field(default_factory=dict)  # (rank, what) -> first and last bar seen
    counters: counters.Counters = field(default_factory=counters.Counters)  # step/iter/batch N in log lines
    seen: set = field(default_factory=set)
    last_code: dict[int | None, str] = field(default_factory=dict)  # per rank: last traceback source line


def parse_torch_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """Parse (line number, text) pairs that are not NCCL lines."""
    st = _State(src=src, ev=ev)
    for item in numbered:
        lineno, text = item[0], item[1]
        rank, body = strip_rank_prefix(text)
        if rank is None and len(item) > 2:  # the reader took the launcher's prefix off and kept its rank
            rank = item[2]  # type: ignore[misc]
        msg = _LOG_HEADER.sub("", body, count=1)
        ln = _Line(lineno, text, rank, body, msg)
        try:
            _one(ln, st)
        except (ValueError, IndexError, KeyError):  # a mangled line is skipped, never fatal
            continue
    for key, tb in list(st.tb.items()):
        # A traceback cut before its exception line whose innermost frame blocks (a Ctrl-C's echo `^C` before it,
        # or a queue get / poll / lock wait): the paste lost the KeyboardInterrupt line; the frames are still
        # where that process waited.
        where = tb.get("where")
        if where and (tb.get("interrupt") or where[-1][0] in _BLOCKING_CALLS):
            _interrupted(st, where, where[-1][3], key)
        elif where:
            _cut_traceback(st, tb, key)
    _close_desync(st)
    _close_torchrun(st)
    _flush_monitored(st)
    _flush_ddp(st)
    _link_watchdog_pgs(st)
    _flush_progress(st)
    for rank, ln, fields in st.counters.events():
        _add(st, "step_counter", ln, rank=rank, **fields)


# A tqdm / Lightning bar: `Evaluating:  45%|████▌     | 45/100 [00:10<00:12,  4.50it/s]`.
_BAR = lazy(
    r"(?:^|\s|\r)(?P<desc>[^|\r]{0,80}?)[: ]*(?P<pct>\d{1,3})%\|[^|]{0,200}\| ?(?P<n>\d{1,12})/(?P<total>\d{1,12}|\?) "
    r"\[(?P<elapsed>[\d:]{1,12})(?:<(?P<left>[\d:?]{1,12}))?, {0,3}(?P<rate>[\d.]{1,12}|\?) ?(?P<unit>it/s|s/it"
    r"|[A-Za-z]{1,16}/s|s/[A-Za-z]{1,16})"
)
# tqdm's rate in any unit it was given: `2.51 examples/s` (datasets.map), `5.23ba/s`, `1.2s/it`.
_BAR_RATE = lazy(r"[\d?] ?(?:[A-Za-z]{1,16}/s|s/[A-Za-z]{1,16})[\],]")


def _progress(ln: _Line, st: _State) -> None:
    """A progress bar: keep the first and last of each rank's bar, to tell a moving rank from a stopped one."""
    bars = list(_BAR.finditer(ln.msg))  # several overwritten bars: the last is what the terminal showed
    if not bars:
        return
    m = bars[-1]
    rate = None
    if m["rate"] != "?":
        try:
            rate = float(m["rate"])
            rate = 1 / rate if m["unit"].startswith("s/") and rate else rate
        except ValueError:
            rate = None
    what = " ".join(m["desc"].split()).rstrip(":")[-60:]
    rank = _rank_of(ln, st)
    entry = st.progress.get((rank, what))
    n, total = int(m["n"]), (int(m["total"]) if m["total"].isdigit() else None)
    if entry is None:
        st.progress[(rank, what)] = {
            "first": n,
            "last": n,
            "total": total,
            "rate": rate,
            "line": ln,
            "count": 1,
            "unit": m["unit"],
        }
    else:
        entry.update(last=n, total=total, rate=rate, line=ln, count=entry["count"] + 1, unit=m["unit"])


def _flush_progress(st: _State) -> None:
    for (rank, what), e in st.progress.items():
        _add(st, "progress", e["line"], rank=rank, what=what, first=e["first"], n=e["last"], total=e["total"],
             rate=e["rate"], count=e["count"], unit=e.get("unit"))  # fmt: skip


def _quote(st: _State, ln: _Line) -> Quote:
    return Quote(source=st.src.name, line=ln.lineno, text=ln.text)


def _rank_of(ln: _Line, st: _State) -> int | None:
    if ln.rank is not None:
        return ln.rank
    m = _PG_RANK.search(ln.msg)
    if m and _global_rank(m):
        return int(m["rank"])
    return st.src.rank


def _global_rank(m: re.Match) -> bool:
    """Is a log prefix's `Rank N` the global rank? ProcessGroupNCCL's prefix prints the rank within its own process
    group (createLogPrefix: `[PG ID <uid> PG GUID <guid> Rank <rank_>]`): the global rank only for the default
    group (PG 0, `0(default_pg)`); in PG 97 it is the process's place in that group, not its place in the job."""
    pgid = m["pgid"]
    return pgid is None or pgid == "0" or (m["guid"] or "").startswith("0(")


def _add(st: _State, kind: str, ln: _Line, rank: int | None = None, **fields: Any) -> LogEvent:
    e = LogEvent(
        kind=kind,
        quote=_quote(st, ln),
        host=fields.pop("host", None) or st.src.host,
        rank=rank if rank is not None else _rank_of(ln, st),
        pid=fields.pop("pid", None) or st.src.pid,
        fields=fields,
    )
    st.ev.events.append(e)
    return e


def _once(st: _State, *key: Any) -> bool:
    """True the first time a key is seen: the same message often repeats (log line, then exception)."""
    if key in st.seen:
        return False
    st.seen.add(key)
    return True


def _one(ln: _Line, st: _State) -> None:
    if (
        "it/s" in ln.msg or "s/it" in ln.msg or "%|" in ln.msg and _BAR_RATE.search(ln.msg)
    ) and "/" in ln.msg:
        _progress(ln, st)
        return
    st.counters.note(_rank_of(ln, st), ln.msg, ln.lineno, ln)
    if (found := counters.length(ln.msg)) is not None:
        rank = ln.rank if ln.rank is not None else counters.inline_rank(ln.msg)
        _add(st, "data_length", ln, rank=rank, what=found[0], n=found[1])
    if ln.body[:1].isspace() and ln.body.strip():  # a traceback's source or frame line, even in a fragment
        st.last_code[ln.rank] = ln.body.strip()[:300]
    _traceback(ln, st)
    if "CUDA error: " in ln.msg or "CUDA driver error: " in ln.msg:
        _cuda_error(ln, st)
    if _RDZV_WORDS.search(ln.msg):
        _rendezvous(ln, st)
    _desync(ln, st)
    _torchrun_summary(ln, st)
    msg = ln.msg
    if "Watchdog caught" in msg:
        _watchdog(ln, st)
    if "ast enqueued" in msg:
        _work_progress(ln, st)
    if _MISMATCH in msg:
        _mismatch(ln, st)
    if "monitoredBarrier" in msg:
        _monitored(ln, st)
    if "operation to complete" in msg:
        m = _GLOO_TIMEOUT.search(msg)
        if m and _once(st, "gloo_timeout", _rank_of(ln, st), m.group(0)):
            _add(st, "gloo_timeout", ln, op=m.group(2).lower(), timeout_ms=int(m.group(1)), peer=None)
    if "Received data size" in msg:
        m = _GLOO_SIZE.search(msg)
        if m:
            received = int(m.group(1)) if m.group(1) else None
            expected = int(m.group(2)) if m.group(2) else None
            _add(st, "gloo_size_mismatch", ln, received_bytes=received, expected_bytes=expected)
    if "Connection" in msg or "Broken pipe" in msg:
        _connection(ln, st)
    if "did not receive grad" in msg or _DDP_EXPECTED in msg:
        _ddp(ln, st)
    if "exitcode" in msg or "closing signal" in msg:
        _process_exit(ln, st)
    if "CUDA out of memory" in msg:
        _oom(ln, st)
    if "DataLoader worker" in msg or "encountered in worker" in msg:
        _worker_died(ln, st)


# torch/utils/data: the main process's `_error_if_any_worker_fails()` and the worker's own signal handler.
_WORKER_KILLED = lazy(r"DataLoader worker \(pid (\d{1,10})\) is killed by signal: ([A-Za-z][\w -]{0,40})")
_WORKER_EXITED = lazy(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]{1,200})\) exited unexpectedly(?: with exit code (-?\d{1,4}))?"
)
_WORKER_FAULT = lazy(
    r"Unexpected (bus error|segmentation fault|floating-point exception) encountered in worker"
)


def _worker_died(ln: _Line, st: _State) -> None:
    """A DataLoader worker died under its rank (SIGKILL from the OOM killer, SIGBUS from a full /dev/shm)."""
    msg = ln.msg
    m = _WORKER_KILLED.search(msg)
    if m:
        pids, signal, code = [int(m.group(1))], m.group(2).strip(), None
    elif (m := _WORKER_EXITED.search(msg)) is not None:
        pids, signal = _ranks(m.group(1)), None
        code = int(m.group(2)) if m.group(2) else None
    elif (m := _WORKER_FAULT.search(msg)) is not None:
        pids, signal, code = [], m.group(1).capitalize(), None
    else:
        return
    if _once(st, "worker_died", _rank_of(ln, st), tuple(pids), signal, code):
        _add(st, "dataloader_worker_died", ln, worker_pids=pids, signal=signal, exit_code=code)


def _watchdog(ln: _Line, st: _State) -> None:
    start = ln.msg.find(_WATCHDOG_HEAD)
    end = _WATCHDOG_END.search(ln.msg, start + len(_WATCHDOG_HEAD)) if start >= 0 else None
    if not end:
        return
    args = dict(_WORK_ARG.findall(ln.msg[start + len(_WATCHDOG_HEAD) : end.start()]))
    seq = int(args["SeqNum"]) if args.get("SeqNum", "").isdigit() else None
    raw_op = args.get("OpType", "").strip()
    op = _op_name(raw_op) if raw_op else "unknown"
    pg_m = next((p for p in _PG_RANK.finditer(ln.msg) if p["pgid"] is not None), None)
    before = list(_PG_RANK.finditer(ln.msg[:start]))  # the "[Rank N]" right before the message
    rank = ln.rank if ln.rank is not None else (int(before[-1]["rank"]) if before else _rank_of(ln, st))
    pg = pg_m["pgid"] if pg_m else None
    key = (rank, seq, op)
    old = st.watchdogs.get(key)
    if old is not None:  # the same timeout, repeated by "watchdog thread terminated" / "what():"
        old.fields["repeats"] = old.fields.get("repeats", 0) + 1
        if old.fields.get("pg") is None and pg is not None:
            old.fields["pg"], old.fields["pg_name"] = pg, pg_m["pgname"]
        return
    numel_in, numel_out = args.get("NumelIn"), args.get("NumelOut")
    timeout = args.get("Timeout(ms)")
    e = _add(
        st,
        "watchdog_timeout",
        ln,
        rank=rank,
        seq=seq,
        op=op,
        op_raw=raw_op,
        numel_in=int(numel_in) if numel_in and numel_in.strip().isdigit() else None,
        numel_out=int(numel_out) if numel_out and numel_out.strip().isdigit() else None,
        timeout_ms=int(timeout) if timeout and timeout.strip().isdigit() else None,
        ran_ms=int(end.group(1)),
        pg=pg,
        pg_name=pg_m["pgname"] if pg_m else None,
    )
    st.watchdogs[key] = e


def _work_progress(ln: _Line, st: _State) -> None:
    enq = _LAST_ENQ.search(ln.msg)
    if not enq:
        return
    done, started, at = _LAST_DONE.search(ln.msg), _LAST_START.search(ln.msg), _AT_WORK.search(ln.msg)
    pg = _PG_RANK.search(ln.msg)
    rank = _rank_of(ln, st)
    values = (
        int(enq.group(1)),
        int(done.group(1)) if done else None,
        int(started.group(1)) if started else None,
        int(at.group(1)) if at else None,
    )
    if not _once(st, "work_progress", rank, pg["pgid"] if pg else None, values):
        return
    _add(
        st,
        "work_progress",
        ln,
        rank=rank,
        last_enqueued=values[0],
        last_completed=values[1],
        last_started=values[2],
        at_work=values[3],
        pg=pg["pgid"] if pg else None,
        pg_name=pg["pgname"] if pg else None,
    )


def _link_watchdog_pgs(st: _State) -> None:
    """Give each watchdog timeout its process group (from the work-progress line that follows it) and a record."""
    for e in st.watchdogs.values():
        if e.fields.get("pg") is None:
            for w in st.ev.events:
                if (
                    w.kind == "work_progress"
                    and w.rank == e.rank
                    and w.fields.get("at_work") == e.fields.get("seq")
                    and w.fields.get("pg") is not None
                ):
                    e.fields["pg"], e.fields["pg_name"] = w.fields["pg"], w.fields.get("pg_name")
                    break
        st.ev.collectives.append(
            CollectiveRecord(
                rank=e.rank,
                op=e.fields["op"],
                seq=e.fields["seq"],
                pg=e.fields.get("pg"),
                state="timed_out",
                numel_in=e.fields.get("numel_in"),
                numel_out=e.fields.get("numel_out"),
                host=e.host,
                quote=e.quote,
                origin="torch_log",
            )
        )


def _desync(ln: _Line, st: _State) -> None:
    """TORCH_NCCL_DESYNC_DEBUG's report (TraceUtils.h retrieveDesyncReport): a header, then tab-indented lines."""
    body = ln.body
    head = _DESYNC_HEAD.search(body)
    # The report's own lines, not any line with the word (Ray's "lagging heartbeats", a straggler warning).
    lagging = bool(
        _DESYNC_NEVER.search(body) or _DESYNC_NOT_JOINED.search(body) or _DESYNC_NOT_FINISHED.search(body)
    )
    if st.desync is not None and (head or not body[:1].isspace()):
        _close_desync(st)
    if st.desync is None and not (head or lagging):
        return
    if st.desync is None:
        st.desync = {"lines": [], "reporter": None, "op": None, "seq": None, "first": ln}
    d = st.desync
    d["lines"].append(ln)
    if head:
        d["reporter"], d["op"], d["seq"] = int(head.group(1)), head.group(2), int(head.group(3))


def _close_desync(st: _State) -> None:
    d, st.desync = st.desync, None
    if not d:
        return
    not_finished: list[int] = []
    not_joined: list[int] = []
    never: list[int] = []
    snapshot: list[dict] = []
    quote_line = None
    snap_seq = None
    for ln in d["lines"]:
        text = ln.body.strip().lstrip("- ").strip()
        for pat, into in ((_DESYNC_NOT_FINISHED, not_finished), (_DESYNC_NOT_JOINED, not_joined)):
            m = pat.search(text)
            if m:
                into.extend(_ranks(m.group(1)))
                quote_line = quote_line or ln
        m = _DESYNC_NEVER.search(text)
        if m:
            never.extend(_ranks(m.group(1)))
            quote_line = quote_line or ln
        m = _DESYNC_SNAP_SEQ.match(text)
        if m:
            snap_seq = int(m.group(1))
            continue
        m = _DESYNC_SNAP.match(text)
        if m and snap_seq is not None and not _DESYNC_NOT_JOINED.search(text):
            snapshot.append(
                {"seq": snap_seq, "state": m.group(2), "ranks": _ranks(m.group(1)), "op": m.group(3)}
            )
    ranks = sorted(set(not_finished + not_joined + never))
    quote_ln = quote_line or d["first"]
    reporter = d["reporter"] if d["reporter"] is not None else _rank_of(d["first"], st)
    _add(
        st,
        "desync_report",
        quote_ln,
        rank=reporter,
        message="\n".join(x.body.strip() for x in d["lines"]),
        ranks=ranks,
        not_joined=sorted(set(not_joined)),
        joined_not_finished=sorted(set(not_finished)),
        never_joined=sorted(set(never)),
        timeout_op=_op_name(d["op"]) if d["op"] else None,
        timeout_seq=d["seq"],
        snapshot=snapshot,
    )


def _fingerprints(text: str) -> dict[int, dict[str, str]]:
    """Rank -> fields of each `Rank N is running collective: CollectiveFingerPrint(...)` (nested parens)."""
    out: dict[int, dict[str, str]] = {}
    m = _FINGERPRINT.search(text)
    while m:
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        inner = text[m.end() : i - 1]
        parts: dict[str, str] = {}
        keys = list(_FP_ARG.finditer(inner))
        for k, nxt in zip(keys, keys[1:] + [None], strict=False):
            end = nxt.start() if nxt else len(inner)
            parts[k.group(1)] = inner[k.end() : end].rstrip(", ")
        out[int(m.group(1))] = parts
        m = _FINGERPRINT.search(text, i)  # on from the end of this one: never rescan (quadratic)
    return out


def _mismatch(ln: _Line, st: _State) -> None:
    prints = _fingerprints(ln.msg)
    per_rank: dict[int, dict[str, Any]] = {}
    for r, p in prints.items():
        seq = p.get("SequenceNumber")
        per_rank[r] = {
            "op": _op_name(p["OpType"]) if p.get("OpType") else None,
            "seq": int(seq) if seq and seq.isdigit() else None,
            "shapes": p.get("TensorShape"),
            "dtypes": p.get("TensorDtypes"),
            "devices": p.get("TensorDeviceTypes"),
        }
    diff = ln.msg.split("differ in the following aspects:", 1)
    tb = st.tb.get(ln.rank) or {}
    where = [*tb.get("frames", [])[-3:], st.last_code.get(ln.rank, "")]
    reporter = next(iter(prints), None)  # ProcessGroupWrapper names the reporting rank first
    _add(
        st,
        "collective_mismatch",
        ln,
        rank=ln.rank if ln.rank is not None else reporter,
        ranks=sorted(per_rank),
        per_rank=per_rank,
        differences=diff[1].strip() if len(diff) > 1 else None,
        where=[w for w in where if w],  # the traceback just above: which code issued the collective
    )


def _monitored(ln: _Line, st: _State) -> None:
    m = _MONITORED.search(ln.msg)
    if not m:
        return
    rep = _REPORTER.search(ln.msg)
    reporter = ln.rank if ln.rank is not None else (int(rep.group(1)) if rep else st.src.rank)
    agg = st.monitored.setdefault(reporter, {"ranks": set(), "quote": ln, "best": 0, "timeout_ms": None})
    ranks = _ranks(m.group(1))
    agg["ranks"].update(ranks)
    agg["timeout_ms"] = int(m.group(2))
    if len(ranks) > agg["best"]:  # quote the line naming the most ranks ("Ranks 1, 2 failed ...")
        agg["best"], agg["quote"] = len(ranks), ln


def _flush_monitored(st: _State) -> None:
    for reporter, agg in st.monitored.items():
        _add(
            st,
            "monitored_barrier_failed",
            agg["quote"],
            rank=reporter,
            ranks=sorted(agg["ranks"]),
            timeout_ms=agg["timeout_ms"],
        )


def _connection(ln: _Line, st: _State) -> None:
    msg = ln.msg
    m = _CONN_CLOSED.search(msg)
    if m:
        peer, reason = f"{m.group(1)}:{m.group(2)}", "closed by peer"
    else:
        m = _CONN_ERROR.search(msg)
        if m:
            peer, reason = f"{m.group(2)}:{m.group(3)}", m.group(4).lower()
        else:
            g = _CONN_GENERIC.search(msg)
            # bare "Broken pipe" can come from anything; count it only from torch.distributed / gloo
            if not g or not any(t in msg for t in ("gloo", "c10d", "pair.cc", "ProcessGroup")):
                return
            peer, reason = None, g.group(0).lower()
    if _once(st, "conn", _rank_of(ln, st), peer, reason):
        _add(st, "connection_closed", ln, peer=peer, reason=reason)


def _ddp(ln: _Line, st: _State) -> None:
    msg = ln.msg
    m = _DDP_INDICES.search(msg) or _DDP_NAMES.search(msg)
    rank = int(m.group(1)) if m else _rank_of(ln, st)
    agg = st.ddp.setdefault(rank, {"names": [], "indices": [], "quote": ln, "why": 0})
    if _DDP_NAMES.search(msg):
        agg["names"] = [x.strip() for x in m.group(2).split(",") if x.strip()]
        agg["quote"], agg["why"] = ln, 2
    elif _DDP_INDICES.search(msg):
        agg["indices"] = _ranks(m.group(2))
        if agg["why"] < 2:
            agg["quote"], agg["why"] = ln, 1


def _flush_ddp(st: _State) -> None:
    for rank, agg in st.ddp.items():
        _add(
            st,
            "ddp_unused_parameters",
            agg["quote"],
            rank=rank,
            param_names=agg["names"],
            param_indices=agg["indices"],
        )


def _torchrun_summary(ln: _Line, st: _State) -> None:
    """torchrun's ChildFailedError table: `Root Cause (first observed failure):` then `[0]:` entries."""
    body = ln.body
    if body.startswith("Root Cause (first observed failure)"):
        _close_torchrun(st)
        st.root_cause = True
        return
    if body.startswith("Failures:"):
        _close_torchrun(st)
        st.root_cause = False
        return
    m = _TR_ENTRY.match(body)
    if m:
        _close_torchrun(st)
        st.torchrun = {"root": st.root_cause, "fields": {}, "quote": None, "first": ln}
        return
    if st.torchrun is None:
        return
    f = _TR_FIELD.match(body)
    if f:
        st.torchrun["fields"][f.group(1)] = f.group(2).rstrip()
        if f.group(1) == "exitcode":
            st.torchrun["quote"] = ln
        return
    if _tr_flattened(ln, st.torchrun):
        return
    _close_torchrun(st)


# The same table as it arrives after a rendered copy: the indentation gone, a label alone on its line with its
# value on a later line (`time` / `host` / `2023-09-14 01:45:50` / `node-1`), or fields run together on one line
# (`rank2 (local rank: 2)exitcode: -9 (pid: 36071)error file: <N/A>`).
_TR_LABEL = lazy(r"(time|host|rank|exitcode|error[_ ]file|traceback)\s*:?\s*$")
_TR_GLUED = lazy(
    r"(rank|exitcode|error[_ ]file|traceback)\s*:?\s*(.*?)(?=(?:exitcode|error[_ ]file|traceback)\s*:|$)"
)


def _tr_flattened(ln: _Line, t: dict) -> bool:
    """Read one line of a flattened torchrun entry into t's fields; False when the line is no part of one."""
    body = ln.body.strip()
    pending = t.setdefault("pending", [])
    lab = _TR_LABEL.fullmatch(body)
    if lab:
        pending.append(lab.group(1).replace(" ", "_"))
        return True
    glued = _TR_GLUED.match(body)
    if glued and re.match(r"(rank\s*:?\s*-?\d|exitcode\s*:|error[_ ]file\s*:|traceback\s*:)", body):
        for m in _TR_GLUED.finditer(body):
            if m.group(2).strip():
                t["fields"][m.group(1).replace(" ", "_")] = m.group(2).strip()
        if "exitcode" in t["fields"]:
            t["quote"] = ln
        return True
    if pending and body and len(body) <= 253:
        t["fields"][pending.pop(0)] = body
        return True
    return False


def _close_torchrun(st: _State) -> None:
    t, st.torchrun = st.torchrun, None
    if not t or not t["fields"]:
        return
    f = t["fields"]
    rank_m = re.match(r"(-?\d{1,9})(?!\d)(?: \(local[_ ]rank: (\d{1,9})\))?", f.get("rank", ""))
    exit_m = re.match(r"(-?\d{1,9})(?!\d)(?: \(pid: (\d{1,10})\))?", f.get("exitcode", ""))
    sig = _SIGNAL_NAME.search(f.get("exitcode", "")) or _SIGNAL_NAME.search(f.get("traceback", ""))
    rank = int(rank_m.group(1)) if rank_m else None
    _add(
        st,
        "torchrun_failure",
        t["quote"] or t["first"],
        rank=rank,
        host=f.get("host"),
        pid=int(exit_m.group(2)) if exit_m and exit_m.group(2) else None,
        local_rank=int(rank_m.group(2)) if rank_m and rank_m.group(2) else None,
        exitcode=int(exit_m.group(1)) if exit_m else None,
        signal=sig.group(1) if sig else None,
        root_cause=t["root"],
        time=f.get("time"),
        error_file=f.get("error_file"),
        traceback=f.get("traceback"),
    )
    if st.ev.events[-1].host:
        st.ev.note_host(st.ev.events[-1].host)


def _process_exit(ln: _Line, st: _State) -> None:
    m = _PROC_FAILED.search(ln.msg)
    if m:
        # torchrun names local ranks here, not global ones: rank stays what the caller knows
        _add(
            st,
            "process_exit",
            ln,
            pid=int(m.group(3)),
            action="failed",
            exitcode=int(m.group(1)),
            local_rank=int(m.group(2)),
            binary=m.group(4),
        )
        return
    m = _PROC_SIGNAL.search(ln.msg)
    if m:
        _add(st, "process_exit", ln, pid=int(m.group(1)), action="closing_signal", signal=m.group(2))


# c10d store, rendezvous and socket failures: the job never got through set-up.
_RDZV_WORDS = lazy(
    r"Rendezvous\w*Error|DistStoreError|client socket has timed out|waiting for (?:clients|workers)"
    r"|Socket Timeout|(?:connect|connection) to \S+ (?:failed|refused)|Connection refused"
    r"|DistNetworkError|client socket has failed to connect"
)
# TCPStore's client: `failed to connect to any network address of (192.168.1.2, 29500)`.
_STORE_ADDR = lazy(r"network address of \(\[?([\w.\-:]{1,253}?)\]?, ?(\d{1,5})\)")
_STORE_TARGET = lazy(r"(?:connect to|connection to) \(?\[?([\w.\-:]{1,253}?)\]?,? ?:?(\d{1,5})?\)?[ .,]")
_JOINED = lazy(r"(\d{1,7})/(\d{1,7}) (?:clients|workers) joined")


def _rendezvous(ln: _Line, st: _State) -> None:
    """A store or rendezvous that timed out or refused: who did not join, where it tried to connect."""
    msg = ln.msg
    kind = "rendezvous_timeout" if "Rendezvous" in msg else "store_timeout"
    if not _once(st, kind, _rank_of(ln, st), msg[:200]):
        return
    fields: dict[str, Any] = {}
    m = _JOINED.search(msg)
    if m:
        fields.update(joined=int(m.group(1)), expected=int(m.group(2)))
    t = _STORE_ADDR.search(msg) or _STORE_TARGET.search(msg)
    if t and t.group(1) != "any":
        fields["target"] = t.group(1) + (f":{t.group(2)}" if t.group(2) else "")
    if "refused" in msg:
        fields["refused"] = True
    unreachable = re.search(r"No route to host|Network is unreachable|Name or service not known", msg)
    if unreachable:
        fields["unreachable"] = unreachable.group(0)
    _add(st, kind, ln, **fields)


_CUDA_ERROR = lazy(r"CUDA (?:driver )?error: ([^.\n]{1,200})")


def _cuda_error(ln: _Line, st: _State) -> None:
    """`CUDA error: an illegal memory access was encountered`: the process that prints it dies of it."""
    m = _CUDA_ERROR.search(ln.msg)
    if m and _once(st, "cuda_error", _rank_of(ln, st), m.group(1).strip()):
        _add(st, "cuda_error", ln, error=m.group(1).strip())


def _oom(ln: _Line, st: _State) -> None:
    m = _OOM.search(ln.msg)
    if not m or not _once(st, "oom", _rank_of(ln, st), ln.msg):
        return
    gpu = _OOM_GPU.search(ln.msg)
    total = _OOM_TOTAL.search(ln.msg)
    old = None if total else _OOM_TOTAL_OLD.search(ln.msg)
    free = _OOM_FREE_OLD.search(ln.msg, old.end()) if old else None
    sizes = total.groups() if total else (old.group(1), free.group(1)) if free else (None, None)
    _add(
        st,
        "cuda_oom",
        ln,
        tried_to_allocate=m.group(1),
        tried_to_allocate_bytes=_bytes(m.group(1)),
        gpu=int(gpu.group(1)) if gpu else None,
        total_capacity=sizes[0],
        free=sizes[1],
    )


# Standard-library calls that block until another thread or process acts (queue, multiprocessing, threading,
# selectors, socket).
_BLOCKING_CALLS = frozenset(
    {"wait", "_poll", "poll", "get", "acquire", "select", "recv", "recv_bytes", "_recv", "_recv_bytes", "accept",
     "join", "__enter__", "read"}
)  # fmt: skip


def _traceback(ln: _Line, st: _State) -> None:
    """Python tracebacks, one per rank prefix at a time; the exception line ends one and is the quote."""
    key, body = ln.rank, ln.body
    interrupt = body.startswith("^C")  # the terminal's echo of the Ctrl-C that stopped a hung process
    if interrupt:
        body = body[2:]
    if body.startswith("Traceback (most recent call last):"):
        st.tb[key] = {"frames": [], "interrupt": interrupt, "start": ln.lineno}
        st.last_exc.pop(key, None)
        return
    head = _IPY_HEAD.match(body) if "Traceback (most recent call last)" in body else None
    if head:
        st.tb[key] = {"frames": [], "ipython": head["type"]}
        st.last_exc.pop(key, None)
        return
    tb = st.tb.get(key)
    if tb is None and _FRAME.match(body):
        # A traceback pasted from its middle: the header was trimmed, the frames and the exception line are not.
        tb = st.tb[key] = {"frames": [], "headless": True}
        st.last_exc.pop(key, None)
    if tb is None:
        _exception_continuation(ln, st)
        return
    if tb.get("ipython") and not _ipython_exception(body, tb["ipython"]):
        _ipython_line(ln, body, tb)
        return
    f = _FRAME.match(body)
    if f:
        tb["frames"].append(f"{f['file']}:{f['line']} in {f['func']}")
        tb.setdefault("where", []).append((f["func"], f["file"], int(f["line"]), ln))
        tb["source_lines"] = 0
        return
    if not body.strip() or body[:1].isspace():
        return  # source lines and carets
    m = _EXC_LINE.match(body.rstrip())
    if tb.get("source_lines", _SOURCE_LINES) < _SOURCE_LINES and _source_line(body, m):
        # A frame's source line (and its carets) that lost its indentation: a paste that strips leading blanks
        # (a launcher's prefix taken off, a word wrap), not the exception that ends the traceback.
        tb["source_lines"] += 1
        return
    del st.tb[key]
    if not m or m["type"].endswith("ChildFailedError"):
        return  # torchrun's own ChildFailedError: its table is read as torchrun_failure
    e = _add(
        st,
        "exception",
        ln,
        exc_type=m["type"],
        message=(m["msg"] or "").strip(),
        frames=tb["frames"],
    )
    if key is not None:
        st.last_exc[key] = e
    if m["type"] == "KeyboardInterrupt" and tb.get("where"):
        _interrupted(st, tb["where"], ln, key)


# Lines after a frame that are its source, when indentation was lost: the statement (word-wrapped, up to two
# pieces) and Python 3.11's carets.
_SOURCE_LINES = 3


def _source_line(body: str, exc: re.Match[str] | None) -> bool:
    """Is this unindented line after a frame its source line, not an exception? It must read as code: a call or an
    assignment (`self.f(x)`, `x = y`), a statement keyword (`raise`, `return x`), or Python's carets; never `Type:
    message`, a bare exception type, or a log message that merely follows the traceback."""
    text = body.strip()
    if set(text) <= set("^~ "):
        return True
    if exc is not None:
        return keyword.iskeyword(exc["type"].split(".")[0])  # `return`, `raise` alone on their line
    first = text.split(None, 1)[0].rstrip(":")
    return keyword.iskeyword(first) or "(" in text or bool(_ASSIGN.search(text))


_ASSIGN = lazy(r"^[\w.\[\]'\", ]{1,200}(?<![=!<>])=(?!=)")


def _cut_traceback(st: _State, tb: dict, rank: int | None) -> None:
    """A traceback the paste cut before its exception line: where it ends is all it says. Its frames (innermost
    first) are read through the taxonomy of waits (probes/waits.yaml): a traceback that ends inside the DataLoader's
    code, a file read or a collective says the process failed there (`where`), whatever the exception was."""
    from hangdx.probes import waits
    from hangdx.probes.model import Frame

    frames = [Frame(func, file, line) for func, file, line, _ in reversed(tb["where"])]
    wait = waits.classify(frames, idle=True)
    _add(
        st,
        "traceback_cut",
        tb["where"][-1][3],
        rank=rank,
        frames=tb["frames"],
        where=wait.kind if wait else None,
        op=wait.op if wait else None,
        start=tb.get("start"),
    )


def _ipython_exception(body: str, exc_type: str) -> bool:
    """The line that ends an IPython traceback: its exception type named again (`KeyboardInterrupt: `)."""
    return body.startswith(exc_type) and (len(body) == len(exc_type) or body[len(exc_type)] == ":")


def _ipython_line(ln: _Line, body: str, tb: dict) -> None:
    """A frame of an IPython traceback (`file.py in func(...)`), or the `--> N` arrow that gives its line."""
    f = _IPY_FRAME.match(body.strip())
    if f:
        tb.setdefault("where", []).append((f["func"], f["file"], 0, ln))
        tb["frames"].append(f"{f['file']}:? in {f['func']}")
        return
    a = _IPY_ARROW.match(body.strip())
    if a and tb.get("where"):
        func, file, line, fl = tb["where"][-1]
        if not line:
            tb["where"][-1] = (func, file, int(a["line"]), fl)
            tb["frames"][-1] = f"{file}:{a['line']} in {func}"


def _interrupted(st: _State, where: list, ln: _Line, rank: int | None) -> None:
    """Ctrl-C on a hung process: its traceback ends where the main thread waited; kept as that thread's stack."""
    from hangdx.probes.model import Frame, StackDump, ThreadStack

    frames = [Frame(func, file, line, quote=_quote(st, fl)) for func, file, line, fl in reversed(where)]
    thread = ThreadStack(None, "MainThread", "idle", frames, _quote(st, ln))
    src = st.src
    rank = rank if rank is not None else src.rank
    st.ev.stacks.append(StackDump(src.pid, rank, src.host, [thread], src.name))


def _exception_continuation(ln: _Line, st: _State) -> None:
    """A multi-line exception message goes on under the same `[rankN]:` prefix (DDP's, for one)."""
    e = st.last_exc.get(ln.rank)
    if e is None:
        return
    if ln.body != ln.msg or not ln.body.strip() or len(e.fields["message"]) > 8000:
        st.last_exc.pop(ln.rank, None)  # a log line or a blank line ends the message
        return
    e.fields["message"] += "\n" + ln.body.strip()
