"""nccl-tests output (all_reduce_perf, all_gather_perf, sendrecv_perf, ...) and results listed per node set.

What a run of a perf binary prints (nccl-tests 2.x):

    # nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 ...
    #
    # Using devices
    #  Rank  0 Group  0 Pid  58680 on       sw53 device  0 [0xb1] Tesla V100-PCIE-32GB
    #  Rank  1 Group  0 Pid 928295 on       sw54 device  0 [0xb1] Tesla V100-PCIE-32GB
    #
    #                                                              out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
               8             2     float     sum      -1    17.39    0.00    0.00      0    16.26    0.00    0.00      0
    # Out of bounds values : 0 OK
    # Avg bus bandwidth    : 1.15327

One `nccl_tests_run` event per run (quoting its `# Avg bus bandwidth` line, else its last row): the hosts and
devices of its ranks, its average and peak bus bandwidth, and how many values it found wrong (`#wrong`, summed
over sizes and in- and out-of-place). Older versions print an `error` column (a maximum error, not a count): it
is not counted.

People who test a cluster node by node run the binary on many node sets and list the result per set:

    se02gn644,se02gn699     49.36
    se02gn632,se02gn641     88.36   # crossing TOR

One `node_set_result` event per such line: the hosts of the set and the figure (a bus bandwidth unless a header
says it is a time).
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines

KIND = "nccl_tests"
QUIET_WHEN_EMPTY = True

_NTHREAD = lazy(r"^#\s*nThread\s+\d{1,6}\s+nGpus\s+\d{1,6}")
# `#  Rank  0 Group  0 Pid  58680 on  sw53 device  0 [0xb1] Tesla V100-PCIE-32GB` (older: no `Group`)
_RANK = lazy(
    r"^#\s*Rank\s+(\d{1,7})(?:\s+Group\s+\d{1,7})?\s+Pid\s+(\d{1,10})\s+on\s+(\S{1,253})\s+device\s+(\d{1,4})"
    r"(?:\s+\[(0x[0-9a-fA-F]{1,8}|[0-9a-fA-F:.]{1,20})\])?\s*(.*)$"
)
# NCCL 1.x's tests (nvidia/nccl test/single/*.cu, one process driving every GPU of its host): `#   Rank %2d uses
# device %2d [0x%02x] %s` per GPU, then the columns `# bytes N type op time algbw busbw res ...`. A paste may have
# lost the `#` (quoted as markdown instead): these two shapes are specific enough to read without it.
_RANK_ONE_PROCESS = lazy(
    r"^#?\s*Rank\s+(\d{1,7})\s+uses device\s+(\d{1,4})(?:\s+\[(0x[0-9a-fA-F]{1,8})\])?\s*(.*)$"
)
_COLUMNS = lazy(r"^#?\s*(?:size\s+count\s+type|bytes\s+N\s+type\s+op\s+time)\b")
_AVG = lazy(r"^#\s*Avg bus bandwidth\s*:\s*([\d.]{1,20})")
_OOB = lazy(r"^#\s*Out of bounds values\s*:\s*(\d{1,12})\s+(\w+)")
# NCCLCHECK's report of an NCCL call that failed (src/common.h): `host: Test NCCL failure common.cu:959 'internal
# error - please report this issue to the NCCL developers / '` (before NCCL 2.13 without ` / <last error>`). The
# binary prints its device list (`# Using devices`, util.cu), then creates its communicators (initComms, then
# buffer registration, common.cu), and only then the results' column header (writeResultHeader): a failure between
# the device list and that header is one of communicator set-up.
_FAILURE = lazy(r"(?:(?:^|\s)(\S{1,253}): )?Test NCCL failure ([^\s:]{1,200}):(\d{1,7}) '([^'\n]{0,400})")
_NUM = r"(?:\d{1,15}(?:\.\d{1,12})?|N/A|[\d.]{1,12}e[+-]\d{1,3})"
# A result row: size, count, type, [redop], [root], then out-of-place and in-place (time algbw busbw #wrong).
_ROW = lazy(
    rf"^\s*\d{{1,15}}\s+\d{{1,15}}\s+[a-z][a-z0-9_]{{0,15}}(?:\s+[a-z][a-z_]{{0,15}})?(?:\s+-?\d{{1,6}})?(?:\s+{_NUM}){{8}}\s*$"
)
# A node set and its figure: `node1,node2   49.36`, `node1, node2: 49.36 GB/s  # comment`.
# One way only to match a name (no comma or space in it), so a long line cannot make the pattern backtrack; that
# every name holds a digit (gpu-b01, not "Total") is checked after the match.
_HOSTNAME = r"[A-Za-z][\w.\-]{0,125}"
_NODE_SET = lazy(
    rf"^\s*({_HOSTNAME}(?:\s{{0,2}},\s{{0,2}}{_HOSTNAME}){{1,63}})\s*[:|=]?\s+(\d{{1,9}}(?:\.\d{{1,9}})?)"
    r"\s*(GB/s|Gb/s|GB/S|Gbps|us|ms|s)?\s*(?:#.*|\(.*\))?$"
)


def _node_set(line: str) -> re.Match | None:
    if "," not in line or len(line) > 8192:
        return None
    m = _NODE_SET.match(line)
    if m is None or not all(any(c.isdigit() for c in h) for h in m.group(1).split(",")):
        return None
    return m


_TIME_HEADER = lazy(r"\b(?:time|latency|us|ms|seconds?)\b", re.I)


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    rows = [ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("```")]
    if any(_NTHREAD.match(ln.strip()) or _AVG.match(ln.strip()) for ln in rows):
        return 90
    if any(_COLUMNS.match(ln.strip()) for ln in rows):
        return 85
    if sum(1 for ln in rows if _RANK_ONE_PROCESS.match(ln.strip())) >= 2:
        return 70
    sets = sum(1 for ln in rows if _node_set(ln))
    if sets >= 2 and sets * 10 >= len(rows) * 6:
        return 60
    return 0


def claims(line: str) -> int:
    """How surely one line is nccl-tests output or a result per node set (see probes/reader.py)."""
    s = line.strip()
    if _RANK_ONE_PROCESS.match(s) or _COLUMNS.match(s):
        return 9
    if s.startswith("#"):
        if _NTHREAD.match(s) or _AVG.match(s) or _RANK.match(s) or _OOB.match(s):
            return 9
        return 0
    if _ROW.match(line):
        return 6
    if "Test NCCL failure " in line and _FAILURE.search(line):
        return 8
    if _node_set(line):
        return 5
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


class _Run:
    def __init__(self) -> None:
        self.ranks: dict[int, dict] = {}
        self.rows = 0
        self.busbw: list[float] = []
        self.wrong = 0
        self.wrong_quotes: list[Quote] = []
        self.avg: float | None = None
        self.oob: int | None = None
        self.quote: Quote | None = None
        self.first: Quote | None = None
        self.last_rank: Quote | None = None  # the device list's last line: communicators are made after it
        self.header: Quote | None = None  # the results' column header: printed once the communicators exist
        self.one_process = False  # NCCL 1.x's tests: one process drives every GPU, on one host

    @property
    def started(self) -> bool:
        return bool(self.rows or self.avg is not None)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    run = _Run()
    time_figures = False  # a header over the node sets said its figures are times
    for item in numbered:
        no, raw = item[0], item[1]
        s = raw.strip()
        if not s:
            continue
        q = Quote(src.name, no, raw)
        if s.startswith("#") or _RANK_ONE_PROCESS.match(s) or _COLUMNS.match(s):
            one = _RANK_ONE_PROCESS.match(s)
            if _NTHREAD.match(s) or ((_RANK.match(s) or one) and run.started):
                _flush(run, src, ev)
                run = _Run()
            if one is not None:  # every GPU in the one process that prints: one host, its name not given
                run.ranks[int(one.group(1))] = {
                    "host": src.host,
                    "pid": src.pid,
                    "device": int(one.group(2)),
                    "bus_id": one.group(3),
                    "gpu": one.group(4).strip() or None,
                }
                run.one_process = True
                run.first = run.first or q
                run.last_rank = q
            elif (m := _RANK.match(s)) is not None:
                run.ranks[int(m.group(1))] = {
                    "host": m.group(3),
                    "pid": int(m.group(2)),
                    "device": int(m.group(4)),
                    "bus_id": m.group(5),
                    "gpu": m.group(6).strip() or None,
                }
                run.first = run.first or q
                run.last_rank = q
            elif (m := _AVG.match(s)) is not None:
                try:
                    run.avg = float(m.group(1))
                except ValueError:
                    continue
                run.quote = q
                _flush(run, src, ev)
                run = _Run()
            elif _COLUMNS.match(s):  # the results' column header (writeResultHeader, common.cu)
                run.header = q
            elif (m := _OOB.match(s)) is not None:
                run.oob = int(m.group(1))
                if run.oob:
                    run.wrong_quotes.append(q)
            continue
        if (m := _ROW.match(raw)) is not None:
            vals = raw.split()[-8:]
            run.rows += 1
            run.quote = run.quote if run.avg is not None else q
            # out-of-place then in-place: time, algbw, busbw, #wrong (4 columns each)
            for part in (vals[0:4], vals[4:8]):
                if len(part) < 4:
                    continue
                try:
                    run.busbw.append(float(part[2]))
                except ValueError:
                    pass
                if part[3].isdigit() and int(part[3]) > 0:
                    run.wrong += int(part[3])
                    if q not in run.wrong_quotes:
                        run.wrong_quotes.append(q)
            continue
        if "Test NCCL failure " in raw and (m := _FAILURE.search(raw)) is not None:
            # No stage of its own: one printed right after the device list (the communicators' creation, a
            # `comm_init_start` below) is set-up's, which playbooks/nccl_logs.py reads from the order of lines.
            error = m.group(4).strip().removesuffix("/").strip()
            host = m.group(1) or src.host
            ev.events.append(
                LogEvent(
                    "nccl_error",
                    q,
                    host=host,
                    fields={"error": error, "message": error, "file": m.group(2), "line": int(m.group(3))},
                )
            )
            if host:
                ev.note_host(host)
            continue
        if (m := _node_set(raw)) is not None:
            hosts = [h.strip() for h in m.group(1).split(",")]
            unit = m.group(3) or ""
            is_time = time_figures or unit in ("us", "ms", "s")
            ev.events.append(
                LogEvent(
                    "node_set_result",
                    q,
                    host=src.host,
                    fields={
                        "hosts": hosts,
                        "value": float(m.group(2)),
                        "higher_is_better": not is_time,
                        "note": (raw.split("#", 1)[1].strip() if "#" in raw else ""),
                    },
                )
            )
            continue
        if _TIME_HEADER.search(s) and len(s.split()) <= 6 and not any(c.isdigit() for c in s):
            time_figures = True  # `nodes  time(us)` over the sets
    _flush(run, src, ev)


def _flush(run: _Run, src: Source, ev: Evidence) -> None:
    if run.last_rank is not None:
        # The binary lists its devices, then creates its communicators (initComms), and only then prints its
        # results' header and rows: the device list's end is where communicator set-up began.
        ev.events.append(
            LogEvent("comm_init_start", run.last_rank, host=src.host, fields={"emitter": "nccl-tests"})
        )
        run.last_rank = None
    if not run.started:
        if run.header is not None and run.ranks:
            # The communicators were made and the header printed; not one size's row followed: the warm-up of the
            # first collective never finished (or the text ends there).
            hosts = sorted({r["host"] for r in run.ranks.values() if r["host"]})
            one_host = run.one_process or len({r["host"] for r in run.ranks.values()}) == 1
            ev.events.append(
                LogEvent(
                    "nccl_tests_stalled",
                    run.header,
                    host=hosts[0] if len(hosts) == 1 else src.host,
                    fields={
                        "hosts": hosts,
                        "one_host": one_host,
                        "gpus": len(run.ranks),
                        "rank_quote": run.first,
                    },
                )
            )
        return
    hosts = sorted({r["host"] for r in run.ranks.values() if r["host"]})
    quote = run.quote or run.first
    if quote is None:
        return
    ev.events.append(
        LogEvent(
            "nccl_tests_run",
            quote,
            host=hosts[0] if len(hosts) == 1 else src.host,
            fields={
                "hosts": hosts,
                "ranks": run.ranks,
                "avg_busbw": run.avg,
                "peak_busbw": max(run.busbw) if run.busbw else None,
                "rows": run.rows,
                "wrong": run.wrong + (run.oob or 0),
                "wrong_quotes": run.wrong_quotes[:6],
                "rank_quote": run.first,
            },
        )
    )
    for h in hosts:
        ev.note_host(h)
