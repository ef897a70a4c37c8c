"""NCCL RAS reports: what `ncclras` (NCCL >= 2.24) prints, as text and as JSON (`ncclras -f json`, NCCL >= 2.28.7).

Every NCCL process runs a RAS thread; the threads watch each other, and any one of them answers `ncclras` on
its node (localhost:28028, or NCCL_RAS_ADDR) for the whole job: every communicator, every rank. The formats are
those of NVIDIA/nccl src/ras/client_support.cc (rasClientRunInit, rasClientRunComms, the json* writers):

    NCCL version 2.26.2 compiled with CUDA 12.6
    ...
    Errors
    ======

    DEAD
      1 job process is considered dead (unreachable via the RAS network)
      Process 3487984 on node 172.16.64.213 managing GPU 5

    #0-0 (cf264af53edbe986) INCOMPLETE
      Missing communicator data from 1 rank
      Rank 21 -- GPU 5 managed by process 3487984 on node 172.16.64.213     (2.24-2.25: `The missing rank: 21`)

    Warnings
    ========

    #0-0 (fa93daea854b060b) MISMATCH
      Communicator ranks have different AllGather operation counts           (2.24-2.25: `collective operation`)
      30 ranks have launched up to operation 640
      2 ranks have launched up to operation 641
      Rank 12 -- GPU 4 managed by process 323032 on node 10.137.190.124

The JSON form lists every rank of every communicator with its host, pid, CUDA/NVML device, status and its count
of each collective type, and the missing ranks with `unresponsive` and `considered_dead`.

One `ncclras_report` event per report (a file may hold several: two queries a few seconds apart tell a stuck
communicator from one caught mid-flight). Its fields, the same from either form:
    format ("text" | "json"), version, timestamp, timeouts,
    dead / unreachable: [{"pid", "host", "gpus", "quote"}]   processes RAS declared dead / got no data from
    comms: [{"id", "hash", "size", "missing": {rank: {...}}, "errors": [...],
             "counts": {op: {"groups": [{"value", "count", "ranks": {rank: {...}}, "quote"}]}}}]
A rank's dict holds what the report says of it: "host", "pid", "gpu" (the CUDA device, as printed), "quote".
A report cut short (a truncated JSON, a text missing its sections) is read as far as it goes, with a gap naming
what is missing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import decode, looks_binary

KIND = "ncclras"

_HOST = r"[0-9A-Za-z][0-9A-Za-z.:_%\-]{0,253}"  # ncclSocketToHost: an IPv4 or IPv6 address
_GPU = r"\d{1,4}(?: \(NVML \d{1,4}\))?"
_GPUS = r"\d{1,4}(?:,\d{1,4}){0,63}(?: \(NVML \d{1,4}(?:,\d{1,4}){0,63}\))?"

_VERSION = lazy(r"^NCCL version (\S{1,40}) compiled with CUDA (\S{1,20})$")
_CUDA = lazy(r"^CUDA runtime version (-?\d{1,9}), driver version (-?\d{1,9})$")
_COMMUNICATORS = lazy(r"^Communicators\.\.\.(?: \((\d{1,9}\.\d{1,3})s\))?$")
_TABLE_HEAD = lazy(r"^Group\s+Comms\s+Nodes\s+Ranks\s+Ranks\s+Ranks\s+Status\s+Errors$")
# `%5d  %8d  %8d  %8s  %8d  %8d  %8s  %6s`: group, comms in group, nodes per comm, ranks per node, ranks per comm,
# ranks in group, status, errors.
_TABLE_ROW = lazy(
    r"^\s*(\d{1,6})\s+(\d{1,9})\s+(\d{1,9})\s+(\d{1,4}(?:-\d{1,4})?)\s+(\d{1,9})\s+(\d{1,9})\s+"
    r"(NOCOMM|INIT|RUNNING|FINALIZE|ABORT)\s+((?:OK|MISMATCH|ERROR|INCOMPLETE)(?:,(?:MISMATCH|ERROR|INCOMPLETE)){0,2})$"
)
_SECTION = lazy(r"^(Errors|Warnings|INCOMPLETE|DEAD|TIMEOUT)$")
_COMM = lazy(r"^#(\d{1,6})-(\d{1,9}) \(([0-9a-f]{1,16})\) (INCOMPLETE|ERROR|MISMATCH)$")
_MISSING_PROCS = lazy(r"^Missing communicator data from (\d{1,9}) job process(?:es)?$")
_DEAD_PROCS = lazy(
    r"^(\d{1,9}) job process(?:es are| is) considered dead \(unreachable via the RAS network\)$"
)
_PROCESS = lazy(rf"^Process (\d{{1,10}}) on node ({_HOST}) managing GPUs? ({_GPUS})$")
_NOT_FOUND = lazy(r"^\[could not find information on (\d{1,9}) process(?:es)?\]$")
_MISSING_RANKS = lazy(r"^Missing communicator data from (\d{1,9}) ranks?$")
_MISSING_LIST = lazy(r"^The missing ranks?: (\d{1,9}(?:, ?\d{1,9}){0,63})")  # NCCL 2.24-2.25
_TIMEOUTS = lazy(r"^Encountered (\d{1,9}) communication timeouts? while gathering communicator data$")
_DIFF_COUNTS = lazy(r"^Communicator ranks have different (\w{1,20}) operation counts$")
_DIFF_STATUS = lazy(r"^Communicator ranks have different status$")
_GROUP = lazy(r"^(\d{1,9}) ranks have (?:launched up to operation (\d{1,20})|(not launched any operations))$")
_GROUP_STATUS = lazy(r"^(\d{1,9}) ranks have status (NOCOMM|UNKNOWN|INIT|RUNNING|FINALIZE|ABORT)$")
_GROUP_ERROR = lazy(r"^(\d{1,9}) ranks reported (.{1,60})$")
_ERRORS_ON = lazy(r"^(Initialization|Asynchronous) errors? on (\d{1,9}) ranks?$")
_WHERE = rf"(?:GPU (?P<gpu>{_GPU}) managed by process (?P<pid>\d{{1,10}}) on node (?P<host>{_HOST})|\[process information not found\])"
_MEMBER = lazy(rf"^Rank (?P<rank>\d{{1,9}}) -- {_WHERE}$")
_ONE_COUNT = lazy(
    rf"^Rank (?P<rank>\d{{1,9}}) has (?:launched up to operation (?P<value>\d{{1,20}})|(?P<none>not launched any operations)) -- {_WHERE}$"
)
_ONE_STATUS = lazy(rf"^Rank (?P<rank>\d{{1,9}}) has status (?P<status>[A-Z]{{3,10}}) -- {_WHERE}$")
_ONE_ERROR = lazy(rf"^Rank (?P<rank>\d{{1,9}}) reported (?P<error>.{{1,60}}?) -- {_WHERE}$")

# Lines only ncclras prints: how the reader (probes/reader.py) knows a region is a RAS report.
_OWN = (
    _VERSION,
    _COMMUNICATORS,
    _TABLE_HEAD,
    _COMM,
    _MISSING_PROCS,
    _DEAD_PROCS,
    _PROCESS,
    _MISSING_RANKS,
    _MISSING_LIST,
    _DIFF_COUNTS,
    _DIFF_STATUS,
    _GROUP,
    _GROUP_STATUS,
    _MEMBER,
    _ONE_COUNT,
    _ONE_STATUS,
    _ONE_ERROR,
    _TIMEOUTS,
)

_JSON_KEYS = (b'"nccl_version"', b'"communicators"')


def sniff(head: bytes) -> int:
    if not head or looks_binary(head[:8192]):
        return 0
    if head.lstrip()[:1] == b"{":
        return 95 if all(k in head[:4096] for k in _JSON_KEYS) else 0
    text = head[:32768].decode("utf-8", errors="replace")
    rows = text.splitlines()
    own = sum(1 for ln in rows if claims(ln))
    if own >= 2 and (
        "Job summary" in text or "Communicators..." in text or any(_COMM.match(ln.strip()) for ln in rows)
    ):
        return 92
    return 0


# Every line of every text meets claims(): how a report's lines begin rules out nearly all others at once.
_STARTS = ("Rank ", "Process ", "Communicator", "NCCL version ", "Missing ", "Encountered ", "Group ", "Job summary",
           "The missing ", "#")  # fmt: skip


def claims(line: str) -> int:
    """How surely one line is part of an ncclras report (see probes/reader.py)."""
    s = line.strip()
    if not s or len(s) > 400 or not (s[0].isdigit() or s.startswith(_STARTS)):
        return 0
    if s in ("Job summary", "Communicators...") or _TABLE_HEAD.match(s):
        return 9
    if any(p.match(s) for p in _OWN):
        return 9
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    if looks_binary(data[:8192]):
        ev.gap(src.name, "binary content, not an ncclras report: skipped")
        return
    if data.lstrip()[:1] == b"{":
        # A JSON report is read whole (decode() keeps a huge log's tail only).
        _parse_json(data.decode("utf-8", errors="replace").replace("\x00", ""), src, ev)
        return
    parse_lines(list(enumerate(_lines(decode(data)), 1)), src, ev)


def _lines(text: str) -> list[str]:
    """Numbered as an editor numbers them, as every parser's quotes are (probes/text.py's lines)."""
    out = text.split("\n")
    if out and out[-1] == "":
        out.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in out]


# -- the text form ------------------------------------------------------------------------------------------


@dataclass
class _Report:
    fmt: str
    first: Quote
    version: str | None = None
    timestamp: str | None = None
    cuda: str | None = None
    timeouts: int = 0
    dead: list[dict] = field(default_factory=list)
    unreachable: list[dict] = field(default_factory=list)
    dead_count: int | None = None
    unreachable_count: int | None = None
    comms: dict[str, dict] = field(default_factory=dict)
    table: list[dict] = field(default_factory=list)
    sections: set[str] = field(default_factory=set)
    lacking: list[str] = field(default_factory=list)
    skipped: int = (
        0  # JSON entries not as NCCL writes them (a communicator not an object, a rank without its number)
    )

    def comm(self, cid: str, chash: str | None = None) -> dict:
        c = self.comms.get(cid)
        if c is None:
            c = self.comms[cid] = {
                "id": cid,
                "hash": chash,
                "size": None,
                "status": None,
                "errors_flag": None,
                "missing": {},
                "missing_count": None,
                "errors": [],
                "counts": {},
                "statuses": [],
            }
        if chash and not c["hash"]:
            c["hash"] = chash
        return c


def _where(m: re.Match) -> dict:
    if m.group("pid") is None:
        return {}
    return {"host": m.group("host"), "pid": int(m.group("pid")), "gpu": m.group("gpu")}


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines of one or more text reports."""
    reports: list[_Report] = []
    rep: _Report | None = None
    block = ""  # the section line the lines below belong to: DEAD, INCOMPLETE, or a communicator's
    comm: dict | None = None
    op_counts: dict | None = None  # the op whose count groups are being listed
    group: dict | None = None  # the count group the `Rank N -- ...` lines below belong to
    for item in numbered:
        no, raw = item[0], item[1]
        s = raw.strip()
        if not s:
            continue
        q = Quote(src.name, no, raw.rstrip())
        if (m := _VERSION.match(s)) or (
            s == "Job summary" and (rep is None or "Job summary" in rep.sections)
        ):
            if rep is None or rep.version is not None or "Job summary" in rep.sections:
                rep = _Report("text", q)
                reports.append(rep)
            if m:
                rep.version, rep.cuda = m.group(1), m.group(2)
            else:
                rep.sections.add("Job summary")
            block, comm, op_counts, group = "", None, None, None
            continue
        if rep is None:
            rep = _Report("text", q)
            reports.append(rep)
        if s == "Job summary":
            rep.sections.add(s)
            continue
        if (m := _COMMUNICATORS.match(s)) is not None:
            rep.sections.add("Communicators")
            continue
        if _TABLE_HEAD.match(s):
            rep.sections.add("table")
            continue
        if (m := _TABLE_ROW.match(raw)) is not None and "table" in rep.sections:
            rep.table.append(
                {
                    "group": int(m.group(1)),
                    "comms": int(m.group(2)),
                    "nodes": int(m.group(3)),
                    "size": int(m.group(5)),
                    "status": m.group(7),
                    "errors": m.group(8),
                    "quote": q,
                }
            )
            continue
        if (m := _SECTION.match(s)) is not None:
            rep.sections.add(s)
            block, comm, op_counts, group = s, None, None, None
            continue
        if (m := _COMM.match(s)) is not None:
            cid = f"#{m.group(1)}-{m.group(2)}"
            comm = rep.comm(cid, m.group(3))
            comm.setdefault("quotes", []).append(q)
            block, op_counts, group = m.group(4), None, None
            continue
        if block == "DEAD" and (m := _DEAD_PROCS.match(s)):
            rep.dead_count = int(m.group(1))
            rep.dead_quote = q  # type: ignore[attr-defined]
            continue
        if block == "INCOMPLETE" and comm is None and (m := _MISSING_PROCS.match(s)):
            rep.unreachable_count = int(m.group(1))
            rep.unreachable_quote = q  # type: ignore[attr-defined]
            continue
        if (m := _PROCESS.match(s)) is not None and block in ("DEAD", "INCOMPLETE") and comm is None:
            proc = {
                "pid": int(m.group(1)),
                "host": m.group(2),
                "gpus": m.group(3),
                "quote": q,
                "head": getattr(rep, "dead_quote" if block == "DEAD" else "unreachable_quote", None),
            }
            (rep.dead if block == "DEAD" else rep.unreachable).append(proc)
            continue
        if (m := _TIMEOUTS.match(s)) is not None:
            rep.timeouts = int(m.group(1))
            rep.timeout_quote = q  # type: ignore[attr-defined]
            continue
        if comm is None:
            continue
        if block == "INCOMPLETE":
            if (m := _MISSING_RANKS.match(s)) is not None:
                comm["missing_count"] = int(m.group(1))
                comm["missing_quote"] = q
            elif (m := _MISSING_LIST.match(s)) is not None:
                for r in re.split(r", ?", m.group(1)):
                    comm["missing"].setdefault(int(r), {"quote": q})
            elif (m := _MEMBER.match(s)) is not None:
                comm["missing"][int(m.group("rank"))] = {**_where(m), "quote": q}
            continue
        if block == "ERROR":
            if (m := _ERRORS_ON.match(s)) is not None:
                op_counts = {"kind": m.group(1).lower(), "head": q}
                group = None
            elif (m := _GROUP_ERROR.match(s)) is not None and op_counts is not None:
                group = {"error": m.group(2), "count": int(m.group(1)), "ranks": {}, "quote": q}
                comm["errors"].append({**group, "kind": op_counts["kind"], "head": op_counts["head"]})
                group = comm["errors"][-1]
            elif (m := _ONE_ERROR.match(s)) is not None and op_counts is not None:
                comm["errors"].append(
                    {
                        "error": m.group("error"),
                        "count": 1,
                        "kind": op_counts["kind"],
                        "head": op_counts["head"],
                        "ranks": {int(m.group("rank")): {**_where(m), "quote": q}},
                        "quote": q,
                    }
                )
                group = None
            elif (m := _MEMBER.match(s)) is not None and group is not None:
                group["ranks"][int(m.group("rank"))] = {**_where(m), "quote": q}
            continue
        if block == "MISMATCH":
            if (m := _DIFF_COUNTS.match(s)) is not None:
                op_counts = comm["counts"].setdefault(m.group(1), {"groups": [], "quote": q})
                group = None
            elif _DIFF_STATUS.match(s):
                op_counts, group = None, None
                comm["status_quote"] = q
            elif (m := _GROUP.match(s)) is not None and op_counts is not None:
                group = {
                    "value": int(m.group(2)) if m.group(2) else 0,
                    "count": int(m.group(1)),
                    "ranks": {},
                    "quote": q,
                }
                op_counts["groups"].append(group)
            elif (m := _ONE_COUNT.match(s)) is not None and op_counts is not None:
                op_counts["groups"].append(
                    {
                        "value": int(m.group("value")) if m.group("value") else 0,
                        "count": 1,
                        "ranks": {int(m.group("rank")): {**_where(m), "quote": q}},
                        "quote": q,
                    }
                )
                group = None
            elif (m := _GROUP_STATUS.match(s)) is not None:
                group = {"status": m.group(2), "count": int(m.group(1)), "ranks": {}, "quote": q}
                comm["statuses"].append(group)
            elif (m := _ONE_STATUS.match(s)) is not None:
                comm["statuses"].append(
                    {
                        "status": m.group("status"),
                        "count": 1,
                        "ranks": {int(m.group("rank")): {**_where(m), "quote": q}},
                        "quote": q,
                    }
                )
                group = None
            elif (m := _MEMBER.match(s)) is not None and group is not None:
                group["ranks"][int(m.group("rank"))] = {**_where(m), "quote": q}
            continue
    for rep in reports:
        _finish_text(rep)
        _emit(rep, src, ev)


def _finish_text(rep: _Report) -> None:
    """Sizes from the summary table; what a report cut short lacks."""
    by_group: dict[int, dict] = {}
    for row in rep.table:
        by_group[row["group"]] = row
    for cid, c in rep.comms.items():
        g = by_group.get(int(cid[1:].split("-")[0]))
        if g is not None:
            c["size"] = g["size"]
    # A missing rank is dead or unreachable when its process is in those lists. NCCL 2.24-2.25 name the missing
    # ranks by number only: with one dead (or unreachable) process and one missing rank, that rank is that process.
    for kind, procs in (("dead", rep.dead), ("unresponsive", rep.unreachable)):
        by_proc = {(p["host"], p["pid"]): p for p in procs}
        for c in rep.comms.values():
            for info in c["missing"].values():
                if (info.get("host"), info.get("pid")) in by_proc:
                    info[kind] = True
            bare = [r for r, i in c["missing"].items() if i.get("pid") is None]
            if len(procs) == 1 and len(bare) == 1 and len(c["missing"]) == 1:
                p = procs[0]
                c["missing"][bare[0]].update(host=p["host"], pid=p["pid"], gpu=p["gpus"], inferred=True)
                c["missing"][bare[0]][kind] = True
    if rep.version is None:
        return  # an excerpt (no header): nothing to say about what it leaves out
    if "Communicators" not in rep.sections and "table" not in rep.sections:
        rep.lacking.append("its communicator table")
    elif "Errors" not in rep.sections:
        rep.lacking.append("its Errors and Warnings sections")
    elif "Warnings" not in rep.sections:
        rep.lacking.append("its Warnings section (where differing collective counts are listed)")
    if rep.dead_count is not None and len(rep.dead) < min(rep.dead_count, 10):
        rep.lacking.append(f"{rep.dead_count - len(rep.dead)} of the dead processes' lines")


# -- the JSON form ------------------------------------------------------------------------------------------

_J_LINE = lazy(r'^\s*"(\w{1,40})":\s*(.*?),?\s*$')


def _parse_json(text: str, src: Source, ev: Evidence) -> None:
    """NCCL's JSON, whole; cut short, it is read line by line as far as it goes (NCCL writes one field a line)."""
    doc: Any = None
    try:
        doc = json.loads(text)
    except ValueError as e:
        problem = f"{type(e).__name__}: {e}"
    else:
        problem = ""
    lines = _lines(text)
    rep = _Report("json", Quote(src.name, 1, lines[0][:300] if lines else ""))
    where = _json_lines(lines, src, rep)  # comms read from the lines, with the quotes
    if isinstance(doc, dict):
        if not isinstance(doc.get("communicators"), list):
            ev.gap(src.name, "ncclras JSON without a `communicators` list: not a RAS report hangdx can read")
            return
        _json_doc(doc, rep, where, src)
    else:
        got = len(rep.comms)
        ev.gap(
            src.name,
            f"ncclras JSON cut short or damaged ({problem[:160]}): read {got} communicator"
            f"{'s' if got != 1 else ''} up to line {len(lines)}; the rest of the report (later ranks, "
            "missing ranks, the collection footer) is missing",
        )
        if not rep.comms and rep.version is None:
            return
    _emit(rep, src, ev)


def _json_lines(lines: list[str], src: Source, rep: _Report) -> dict[tuple[int, str, int], dict]:
    """Walk NCCL's one-field-a-line layout: every rank's fields and the line each was on."""
    where: dict[tuple[int, str, int], dict] = {}  # (comm index, "ranks" | "missing_ranks", rank) -> fields
    ci = -1
    array = ""
    cur: dict | None = None
    in_counts = False
    for no, raw in enumerate(lines, 1):
        s = raw.strip()
        m = _J_LINE.match(raw)
        if m is None:
            if s.startswith("}") and in_counts:
                in_counts = False
            continue
        key, val = m.group(1), m.group(2)
        q = Quote(src.name, no, raw.rstrip()[:300])
        if key == "nccl_version":
            rep.version = val.strip('"')
            rep.first = q
        elif key == "timestamp" and ci < 0:
            rep.timestamp = val.strip('"')
        elif key == "hash" and val.startswith('"0x'):
            ci += 1
            cid = f"[{ci}]"
            c = rep.comm(cid, val.strip('"')[2:].rjust(16, "0"))
            c["index"] = ci
            c.setdefault("quotes", []).append(q)
            array, cur = "", None
        elif key in ("ranks", "missing_ranks") and val.startswith("["):
            array = key
        elif key == "rank" and ci >= 0 and array:
            try:
                cur = where.setdefault(
                    (ci, array, int(val)), {"rank": int(val), "lines": [q], "counts": {}, "at": {"rank": q}}
                )
            except ValueError:
                cur = None
        elif key == "collective_counts":
            in_counts = True
        elif cur is not None:
            cur["lines"].append(q)
            cur["at"].setdefault(key, q)
            if in_counts:
                try:
                    cur["counts"][key] = int(val)
                except ValueError:
                    pass
            else:
                cur[key] = val.strip('"')
        if key == "timeouts_count":
            try:
                rep.timeouts = int(val)
            except ValueError:
                pass
            rep.timeout_quote = q  # type: ignore[attr-defined]
        if key == "collection_time_sec":
            rep.sections.add("footer")
    if ci >= 0 and "footer" not in rep.sections:
        rep.lacking.append("its footer (the collection time and timeouts count)")
    return where


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _json_doc(doc: dict, rep: _Report, where: dict, src: Source) -> None:
    """The parsed document is the truth; the lines walked give the quotes (a reformatted JSON has fewer)."""
    rep.version = str(doc.get("nccl_version"))[:40] if doc.get("nccl_version") is not None else rep.version
    rep.timestamp = str(doc.get("timestamp"))[:40] if doc.get("timestamp") is not None else rep.timestamp
    ras = doc.get("ras") if isinstance(doc.get("ras"), dict) else {}
    rep.timeouts = _int_or_none(ras.get("timeouts_count")) or 0
    rep.lacking = []
    walked, rep.comms = rep.comms, {}
    first_line = rep.first
    for ci, c in enumerate(doc["communicators"]):
        if not isinstance(c, dict):
            rep.skipped += 1
            continue
        h = str(c.get("hash") or "")[:18]
        comm = rep.comm(f"[{ci}]", h[2:].rjust(16, "0") if h.startswith("0x") else h or None)
        comm["index"] = ci
        comm["quotes"] = walked.get(f"[{ci}]", {}).get("quotes", [])
        comm["size"] = _int_or_none(c.get("size"))
        ranks = c.get("ranks") if isinstance(c.get("ranks"), list) else []
        missing = c.get("missing_ranks") if isinstance(c.get("missing_ranks"), list) else []
        rep.skipped += sum(1 for k in ("ranks", "missing_ranks") if not isinstance(c.get(k), list))
        quote0 = Quote(src.name, first_line.line, first_line.text)
        per_op: dict[str, dict[int, tuple[int, dict]]] = {}
        for r in ranks:
            rank = _int_or_none(r.get("rank")) if isinstance(r, dict) else None
            if rank is None:
                rep.skipped += 1
                continue
            w = where.get((ci, "ranks", rank), {})
            info = _json_rank(r, w, quote0)
            status = r.get("status") if isinstance(r.get("status"), dict) else {}
            for key, what in (("init_state", "initialization"), ("async_error", "asynchronous")):
                code = _int_or_none(status.get(key))
                if code not in (None, 0, 7):
                    comm["errors"].append(
                        {
                            "error": _NCCL_RESULT.get(code, f"ncclResult {code}"),
                            "kind": what,
                            "count": 1,
                            "ranks": {
                                rank: {
                                    **info,
                                    "quotes": [x for x in (_line_of(w, "host"), _line_of(w, "pid")) if x],
                                }
                            },
                            "quote": _line_of(w, key) or info["quote"],
                        }
                    )
            counts = r.get("collective_counts") if isinstance(r.get("collective_counts"), dict) else {}
            for op, n in counts.items():
                if _int_or_none(n) is not None:
                    who = [x for x in (_line_of(w, "host"), _line_of(w, "pid"), _line_of(w, "cuda_dev")) if x]
                    per_op.setdefault(str(op)[:20], {})[rank] = (
                        n,
                        {**info, "quote": _line_of(w, op) or info["quote"], "quotes": [info["quote"], *who]},
                    )
        for r in missing:
            rank = _int_or_none(r.get("rank")) if isinstance(r, dict) else None
            if rank is None:
                rep.skipped += 1
                continue
            w = where.get((ci, "missing_ranks", rank), {})
            info = _json_rank(r, w, quote0)
            status = r.get("status") if isinstance(r.get("status"), dict) else {}
            info["unresponsive"] = status.get("unresponsive") is True
            info["dead"] = status.get("considered_dead") is True
            info["quotes"] = [
                x for x in (_line_of(w, "host"), _line_of(w, "pid"), _line_of(w, "cuda_dev"),
                            _line_of(w, "considered_dead" if info["dead"] else "unresponsive")) if x
            ]  # fmt: skip
            comm["missing"][rank] = info
        comm["missing_count"] = len(comm["missing"])
        for op, by_rank in per_op.items():
            values: dict[int, dict] = {}
            for rank, (n, info) in sorted(by_rank.items()):
                g = values.setdefault(n, {"value": n, "count": 0, "ranks": {}, "quote": info["quote"]})
                g["count"] += 1
                g["ranks"][rank] = info
            if len(values) > 1:
                comm["counts"][op] = {
                    "groups": sorted(values.values(), key=lambda g: (-g["count"], -g["value"])),
                    "quote": None,
                }
    # Dead and unreachable processes, as the text lists them (one per process, not per rank).
    seen: set[tuple] = set()
    for comm in rep.comms.values():
        for info in comm["missing"].values():
            key = (info.get("host"), info.get("pid"))
            if key in seen or info.get("pid") in (None, -1):
                continue
            seen.add(key)
            proc = {
                "pid": info["pid"],
                "host": info.get("host"),
                "gpus": info.get("gpu"),
                "quote": info["quote"],
            }
            if info.get("dead"):
                rep.dead.append(proc)
            elif info.get("unresponsive"):
                rep.unreachable.append(proc)


_NCCL_RESULT = {
    1: "Unhandled CUDA error",
    2: "System error",
    3: "Internal error",
    4: "Invalid argument",
    5: "Invalid usage",
    6: "Remote process error",
    8: "Timeout",
}


def _line_of(w: dict, key: str) -> Quote | None:
    """The line a rank's field was on (its first, should a key repeat)."""
    return w.get("at", {}).get(key)


def _json_rank(r: dict, w: dict, fallback: Quote) -> dict:
    host = r.get("host")
    host = host if isinstance(host, str) and host != "unknown" and re.fullmatch(_HOST, host) else None
    pid = _int_or_none(r.get("pid"))
    cuda, nvml = _int_or_none(r.get("cuda_dev")), _int_or_none(r.get("nvml_dev"))
    gpu = None
    if cuda is not None:
        gpu = str(cuda) if nvml in (None, cuda) else f"{cuda} (NVML {nvml})"
    lines = w.get("lines") or []
    return {
        "host": host,
        "pid": pid if pid not in (None, -1) else None,
        "gpu": gpu,
        "quote": lines[0] if lines else fallback,
    }


# -- one event per report ---------------------------------------------------------------------------------


def _emit(rep: _Report, src: Source, ev: Evidence) -> None:
    comms = sorted(rep.comms.values(), key=lambda c: c["id"])
    if not comms and not rep.dead and not rep.unreachable and rep.version is None and not rep.table:
        return
    fields = {
        "format": rep.fmt,
        "version": rep.version,
        "timestamp": rep.timestamp,
        "timeouts": rep.timeouts,
        "timeout_quote": getattr(rep, "timeout_quote", None),
        "dead": rep.dead,
        "dead_count": rep.dead_count if rep.dead_count is not None else len(rep.dead),
        "dead_quote": getattr(rep, "dead_quote", None),
        "unreachable": rep.unreachable,
        "unreachable_count": rep.unreachable_count
        if rep.unreachable_count is not None
        else len(rep.unreachable),
        "unreachable_quote": getattr(rep, "unreachable_quote", None),
        "comms": comms,
        "table": rep.table,
        "healthy": not comms
        and not rep.dead
        and not rep.unreachable
        and all(r["errors"] == "OK" for r in rep.table),
    }
    ev.events.append(LogEvent("ncclras_report", rep.first, host=src.host, fields=fields))
    # The nodes RAS names are addresses (ncclSocketToHost), not the names hangdx reached the hosts by: they are
    # quoted in findings, never added to the job's hosts.
    if rep.skipped:
        ev.gap(
            src.name,
            f"ncclras JSON: {rep.skipped} entr{'ies' if rep.skipped != 1 else 'y'} not laid out as NCCL writes them "
            "(a communicator, a rank list or a rank without its number): skipped",
        )
    if rep.lacking:
        ev.gap(src.name, "ncclras report read, but it lacks " + "; ".join(rep.lacking) + " (cut short?)")
