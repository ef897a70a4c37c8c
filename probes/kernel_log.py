"""Kernel logs: `dmesg`, `dmesg -T`/`--ctime`, `dmesg --time-format iso`, `journalctl -k` and syslog.

Line prefixes understood:

    [ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    kern  :err   : [ 1234.567890] ...                      (dmesg -x)
    [Sun Nov 22 01:02:03 2026] ...                          (dmesg -T)
    2026-11-22T01:02:03,123456+00:00 ...                    (dmesg --time-format iso)
    Nov 22 01:02:03 gpu-node-03 kernel: ...                 (journalctl -k, /var/log/syslog, messages)
    2026-11-22T01:02:03+0000 gpu-node-03 kernel: ...        (journalctl -o short-iso)

A syslog line names its host; a bare dmesg does not (then `src.host`). Lines without a
prefix (the indented continuation lines NVRM prints) are read as part of the log too.

LogEvents (kind: fields):
    xid: xid, bus_id (0000:3b:00.0), pid, process, gpu_uuid, detail, meaning, action, severity,
         cause (application|hardware|driver|unknown); inferred=True for a bare "fallen off the bus"
         line with no Xid 79 for that GPU
    oom_kill: pid, comm (+ constraint, oom_memcg, uid, memcg, total_vm_kb, anon_rss_kb when printed);
              the `oom-kill:` and `Killed process` lines of one kill make one event
    hung_task: comm, pid, seconds (+ frames: [line, text, function, module] of the call trace after it)
    nfs_not_responding: server, how (still trying | timed out);  nfs_ok: server
    nic_link: device (netdev or mlx5_N; the PCI function for cable events), state (up|down|init),
              driver, bus_id, port + ib_state (mlx5 `Port: 1 Link DOWN`), module + cable
    segfault: comm, pid, addr, signal ("segfault", "general protection fault", ...), library
    pcie_error: device (reporting port/function), bus_id (the device in error), severity
                (corrected | nonfatal | fatal), type
Every event also carries the time as printed: `uptime` (seconds since boot, from `[ 1234.567890]`),
`time_text` (the wall-clock text), and `time` (epoch seconds) only when the text has a UTC offset.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines
from hangdx.probes.xid import describe, likely_cause, normalize_bus_id

KIND = "kernel_log"
# A log with nothing of note in it is the usual case, not a file cut short: no gap for it.
QUIET_WHEN_EMPTY = True

_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_MON = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_UPTIME = lazy(r"^(?:\w+\s*:\s*\w+\s*:\s)?\[\s*(\d+\.\d{3,9})\]\s?")
_CTIME = lazy(rf"^\[({_DAY} {_MON} [ \d]\d \d\d:\d\d:\d\d \d{{4}})\]\s?")
_ISO = lazy(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)\s+")
_SYSLOG = lazy(rf"^({_MON} [ \d]\d \d\d:\d\d:\d\d)\s+")
# After a syslog/short-iso time: "host kernel: " or "host prog[pid]: "
_HOST_PROG = lazy(r"^(\S+)\s+(kernel|[\w./-]+\[\d+\]):\s?")

_BUS = r"(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?"
_PCI_FN = lazy(r"\b([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\b")

_XID = lazy(rf"NVRM: Xid \((?:PCI:)?({_BUS})\): (\d+),\s*(.*)$")
_XID_PID = lazy(r"^pid=(?:'?<unknown>'?|'?(\d+)'?),\s*")
_XID_NAME = lazy(r"^name=([^,]*),\s*")
_GPU_UUID = lazy(rf"NVRM: GPU at (?:PCI:)?({_BUS}): (GPU-[0-9a-fA-F-]+)")
_NVIDIA_GPU = lazy(rf"NVRM: (?:The NVIDIA GPU|GPU at (?:PCI:)?|GPU) ({_BUS})\b")
_FALLEN = lazy(r"fallen off\s+the bus", re.I)

# A task's comm is at most 15 bytes (TASK_COMM_LEN): bounded repeats keep long hostile lines linear.
_OOM_KILLED = lazy(r"(?:(Memory cgroup) )?[Oo]ut of memory: Kill(?:ed)? process (\d+) \(([^)]{0,64})\)(.*)$")
_KILLED = lazy(r"^Killed process (\d+) \(([^)]{0,64})\)(.*)$")
_OOM_KILL = lazy(r"oom-kill:(\S+)")
_HUNG = lazy(r"INFO: task (.{1,64}?):(\d+) blocked for more than (\d+) seconds")
# A frame of the call trace the kernel prints after a hung-task report (`dump_stack`/`show_stack`): old kernels
# `[<ffffffffc08f1b66>] nfs_file_flush+0x46/0x60 [nfs]`, new ones ` nfs_file_flush+0x46/0x60 [nfs]`; `? ` marks a
# frame the unwinder is unsure of.
_FRAME = lazy(
    r"^(?:\[<[0-9a-fA-F]{8,16}>\] )?(?:\? )?([A-Za-z_][\w.]{0,127})\+0x[0-9a-fA-F]{1,16}/0x[0-9a-fA-F]{1,16}"
    r"(?: \[(\w{1,64})\])?$"
)
# Lines of a hung-task report between its INFO line and its frames.
_HUNG_BODY = lazy(
    r"^(?:Call Trace:|<TASK>|</TASK>|Tainted:|\S{1,16}\s+D\s|task:\S|\"echo 0 > /proc/sys/kernel/hung_task|RIP: |RSP: |RAX: |RDX: |RBP: |R\d{1,2}: )"
)
_NFS = lazy(r"\bnfs: server (\S+) (not responding, (still trying|timed out)|OK)\b")
_SEGV = lazy(r"(?<!\S)(\S+)\[(\d+)\]: segfault at (\S+)(.*)$")
_TRAP = lazy(r"traps: (\S+)\[(\d+)\] (general protection fault|trap [\w ]+?)(?: ip| in |$)")
_IN_LIB = lazy(r" in ([^\s\[]+)\[")
_AER_RECEIVED = lazy(
    r"^(\S+) (\S+): AER: (Multiple )?(Corrected|Uncorrected \((?:Non-Fatal|Fatal)\)) error (?:message )?received(?::| from)? ?(\S*)"
)
_AER_BUS_ERROR = lazy(
    r"^(\S+) (\S+): (?:AER: )?PCIe Bus Error: severity=(Corrected|Uncorrected \((?:Non-Fatal|Fatal)\)), type=([^,]+)"
)
_MLX_PORT = lazy(r"^(\S+) (\S+) (\S+): Port: (\d+) Link (ACTIVE|DOWN|INIT|ARMED)\b")
_MODULE_EVENT = lazy(r"Port module event(?:\[error\])?: module (\d+), Cable (\w+)")
_NIC_LINK = lazy(r"(?<![\w:.-])([A-Za-z][\w.@-]*):? NIC Link is (Up|Down)\b")
_LINK = lazy(r"(?<![\w:.-])([A-Za-z][\w.@-]*): [Ll]ink (?:is )?(up|down|Up|Down)\b")
_LINK_READY = lazy(r"ADDRCONF\(NETDEV_CHANGE\): ([\w.@-]+): link becomes ready")
_DRIVER_DEV = lazy(r"^(\S+) ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\b")


class _Line:
    """One kernel-log line split into its time, host and message."""

    __slots__ = ("host", "uptime", "time_text", "time", "msg", "stamped")

    def __init__(self, raw: str) -> None:
        self.host: str | None = None
        self.uptime: float | None = None
        self.time_text: str | None = None
        self.time: float | None = None
        self.stamped = True
        rest = raw
        m = _CTIME.match(rest)
        if m:
            self.time_text = m.group(1)
            rest = rest[m.end() :]
        elif (m := _ISO.match(rest)) is not None:
            self.time_text = m.group(1)
            self.time = _iso_epoch(m.group(1))
            rest = self._host_prog(rest[m.end() :])
        elif (m := _SYSLOG.match(rest)) is not None:
            self.time_text = m.group(1)
            rest = self._host_prog(rest[m.end() :])
        m = _UPTIME.match(rest)
        if m:
            self.uptime = float(m.group(1))
            rest = rest[m.end() :]
        elif self.time_text is None:
            self.stamped = False
        self.msg = rest.strip()

    def _host_prog(self, rest: str) -> str:
        m = _HOST_PROG.match(rest)
        if not m:
            return rest
        self.host = m.group(1)
        return rest[m.end() :]

    def when(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.uptime is not None:
            out["uptime"] = self.uptime
        if self.time_text:
            out["time_text"] = self.time_text
        if self.time is not None:
            out["time"] = self.time
        return out


def _iso_epoch(text: str) -> float | None:
    """Epoch seconds of an ISO time, only when it carries its UTC offset."""
    t = text.replace(",", ".")
    if t.endswith("Z"):
        t = t[:-1] + "+00:00"
    elif re.search(r"[+-]\d{4}$", t):
        t = t[:-2] + ":" + t[-2:]
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        return None
    return dt.timestamp() if dt.tzinfo else None


def _stamped(line: str) -> int:
    """2 for a line with a kernel-log prefix (dmesg time or `host kernel:`), 1 for other syslog lines, else 0."""
    if _UPTIME.match(line) or _CTIME.match(line):
        return 2
    m = _ISO.match(line) or _SYSLOG.match(line)
    if not m:
        return 0
    hp = _HOST_PROG.match(line[m.end() :])
    if hp:
        return 2 if hp.group(2) == "kernel" else 1
    # `dmesg --time-format iso` has no host: accept it when an uptime-free kernel message follows
    return 1 if m.re is _ISO.compiled() else 0


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    rows = [ln for ln in text.splitlines()[:400] if ln.strip()]
    if not rows:
        return 0
    strong = weak = 0
    for ln in rows:
        s = _stamped(ln)
        strong += s == 2
        weak += s == 1
    frac = (strong + weak * 0.5) / len(rows)
    if strong == 0 and weak < 3:
        return 0
    if frac >= 0.6:
        score = 75
    elif frac >= 0.3:
        score = 50
    else:
        score = 15 if strong >= 3 else 5
    if "NVRM: " in text or " kernel: " in text or "Linux version" in text:
        score += 15
    return min(score, 95)


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    state = _State(src, ev)
    for no, raw in numbered:
        if not raw.strip():
            continue
        state.line(no, raw)
    state.finish()


class _State:
    def __init__(self, src: Source, ev: Evidence) -> None:
        self.src, self.ev = src, ev
        self.uuids: dict[str, str] = {}  # bus id -> GPU uuid, from "NVRM: GPU at PCI:...: GPU-..."
        self.xid79: set[str] = set()
        self.inferred: list[LogEvent] = []
        self.pending_gpu: tuple[str, int] | None = None  # "The NVIDIA GPU <bus>" waiting for its next lines
        self.ooms: dict[int, LogEvent] = {}
        self.last_pcie: tuple[int, LogEvent] | None = None
        self.hosts: set[str] = set()
        self.hung_task: LogEvent | None = None  # the hung-task report whose call trace may follow

    def add(self, kind: str, no: int, raw: str, ln: _Line, pid: int | None = None, **fields: Any) -> LogEvent:
        host = ln.host or self.src.host
        fields = {k: v for k, v in fields.items() if v is not None}
        if pid is not None:
            fields["pid"] = pid
        fields.update(ln.when())
        e = LogEvent(
            kind, Quote(self.src.name, no, raw), host=host, rank=self.src.rank, pid=pid, fields=fields
        )
        self.ev.events.append(e)
        if host:
            self.hosts.add(host)
        return e

    def line(self, no: int, raw: str) -> None:
        ln = _Line(raw)
        msg = ln.msg
        if "NVRM:" in msg:
            try:
                self.nvrm(no, raw, ln, msg)
            except ValueError:  # e.g. an Xid code of 5000 digits: skipped, never fatal
                pass
            return
        if self.pending_gpu and no - self.pending_gpu[1] > 3:
            self.pending_gpu = None
        if self.hung_task is not None and self.trace(no, raw, ln, msg):
            return
        for handler in (self.oom, self.hung, self.nfs, self.segfault, self.pcie, self.link):
            try:
                if handler(no, raw, ln, msg):
                    return
            except (ValueError, IndexError):  # a mangled line is skipped, never fatal
                return

    def nvrm(self, no: int, raw: str, ln: _Line, msg: str) -> None:
        m = _XID.search(msg)
        if m:
            self.xid(no, raw, ln, m)
            return
        m = _GPU_UUID.search(msg)
        if m:
            bus = normalize_bus_id(m.group(1))
            if bus:
                self.uuids[bus] = m.group(2)
            return
        m = _NVIDIA_GPU.search(msg)
        if m:
            self.pending_gpu = (normalize_bus_id(m.group(1)) or "", no)
        if _FALLEN.search(msg) and self.pending_gpu and self.pending_gpu[0]:
            bus = self.pending_gpu[0]
            self.pending_gpu = None
            meaning, action, severity = describe(79)
            e = self.add(
                "xid",
                no,
                raw,
                ln,
                xid=79,
                bus_id=bus,
                gpu_uuid=self.uuids.get(bus),
                detail=msg,
                meaning=meaning,
                action=action,
                severity=severity,
                cause=likely_cause(79),
                inferred=True,
            )
            self.inferred.append(e)

    def xid(self, no: int, raw: str, ln: _Line, m: re.Match[str]) -> None:
        bus = normalize_bus_id(m.group(1))
        code = int(m.group(2))
        rest = m.group(3)
        pid = None
        process = None
        pm = _XID_PID.match(rest)
        if pm:
            pid = int(pm.group(1)) if pm.group(1) else None
            rest = rest[pm.end() :]
        nm = _XID_NAME.match(rest)
        if nm:
            name = nm.group(1).strip().strip("'")
            process = None if name in ("", "<unknown>") else name
            rest = rest[nm.end() :]
        if pid == 0:  # the driver's own context, not a user process
            pid = None
        meaning, action, severity = describe(code)
        self.add(
            "xid",
            no,
            raw,
            ln,
            pid=pid,
            xid=code,
            bus_id=bus,
            process=process,
            gpu_uuid=self.uuids.get(bus or ""),
            detail=rest.strip(),
            meaning=meaning,
            action=action,
            severity=severity,
            cause=likely_cause(code),
        )
        if code == 79 and bus:
            self.xid79.add(bus)

    def oom(self, no: int, raw: str, ln: _Line, msg: str) -> bool:
        m = _OOM_KILLED.search(msg)
        if m:
            pid, comm, tail = int(m.group(2)), m.group(3), m.group(4)
            self.oom_event(no, raw, ln, pid, comm, memcg=bool(m.group(1)), **_oom_sizes(tail))
            return True
        m = _KILLED.match(msg)
        if m:
            self.oom_event(no, raw, ln, int(m.group(1)), m.group(2), **_oom_sizes(m.group(3)))
            return True
        m = _OOM_KILL.search(msg)
        if m:
            kv = dict(p.split("=", 1) for p in m.group(1).split(",") if "=" in p)
            if "pid" in kv and kv["pid"].isdigit():
                self.oom_event(
                    no,
                    raw,
                    ln,
                    int(kv["pid"]),
                    kv.get("task"),
                    constraint=kv.get("constraint"),
                    oom_memcg=kv.get("oom_memcg"),
                    uid=kv.get("uid"),
                )
                return True
        return False

    def oom_event(self, no: int, raw: str, ln: _Line, pid: int, comm: str | None, **extra: Any) -> None:
        """One oom_kill per killed pid: the kernel prints `oom-kill:` and `Killed process` for one kill."""
        extra = {k: v for k, v in extra.items() if v not in (None, False)}
        prior = self.ooms.get(pid)
        if prior is not None:
            for k, v in extra.items():
                prior.fields.setdefault(k, v)
            if comm and not prior.fields.get("comm"):
                prior.fields["comm"] = comm
            return
        self.ooms[pid] = self.add("oom_kill", no, raw, ln, pid=pid, comm=comm, **extra)

    def hung(self, no: int, raw: str, ln: _Line, msg: str) -> bool:
        m = _HUNG.search(msg)
        if not m:
            return False
        pid = int(m.group(2))
        self.hung_task = self.add("hung_task", no, raw, ln, pid=pid, comm=m.group(1), seconds=int(m.group(3)))
        return True

    def trace(self, no: int, raw: str, ln: _Line, msg: str) -> bool:
        """A line of the open hung-task report: its frames join the event (`frames`: line, text, function,
        module), innermost first; any other line closes the report."""
        task = self.hung_task
        assert task is not None
        if (ln.host or self.src.host) != task.host:
            self.hung_task = None
            return False
        m = _FRAME.match(msg)
        if m:
            frames = task.fields.setdefault("frames", [])
            if len(frames) < 64:
                frames.append([no, raw.strip(), m.group(1), m.group(2)])
            return True
        if _HUNG_BODY.match(msg):
            return True
        self.hung_task = None
        return False

    def nfs(self, no: int, raw: str, ln: _Line, msg: str) -> bool:
        m = _NFS.search(msg)
        if not m:
            return False
        if m.group(2) == "OK":
            self.add("nfs_ok", no, raw, ln, server=m.group(1))
        else:
            self.add("nfs_not_responding", no, raw, ln, server=m.group(1), how=m.group(3))
        return True

    def segfault(self, no: int, raw: str, ln: _Line, msg: str) -> bool:
        m = _SEGV.search(msg)
        if m:
            pid = int(m.group(2))
            lib = _IN_LIB.search(m.group(4))
            self.add(
                "segfault",
                no,
                raw,
                ln,
                pid=pid,
                comm=m.group(1),
                addr=m.group(3),
                signal="segfault",
                library=lib.group(1) if lib else None,
            )
            return True
        m = _TRAP.search(msg)
        if m:
            pid = int(m.group(2))
            lib = _IN_LIB.search(msg)
            self.add(
                "segfault",
                no,
                raw,
                ln,
                pid=pid,
                comm=m.group(1),
                signal=m.group(3).strip(),
                library=lib.group(1) if lib else None,
            )
            return True
        return False

    def pcie(self, no: int, raw: str, ln: _Line, msg: str) -> bool:
        m = _AER_RECEIVED.match(msg)
        if m:
            target = normalize_bus_id(m.group(5)) if m.group(5) else None
            e = self.add(
                "pcie_error",
                no,
                raw,
                ln,
                device=normalize_bus_id(m.group(2)) or m.group(2),
                bus_id=target or normalize_bus_id(m.group(2)),
                severity=_aer_severity(m.group(4)),
                multiple=True if m.group(3) else None,
            )
            self.last_pcie = (no, e)
            return True
        m = _AER_BUS_ERROR.match(msg)
        if m:
            bus = normalize_bus_id(m.group(2))
            severity = _aer_severity(m.group(3))
            if self.last_pcie:
                prev_no, prev = self.last_pcie
                same = prev.fields.get("bus_id") == bus and prev.fields.get("severity") == severity
                if same and no - prev_no <= 3:  # the detail line of the error just reported
                    prev.fields.setdefault("type", m.group(4).strip())
                    prev.fields.setdefault("driver", m.group(1))
                    return True
            e = self.add(
                "pcie_error",
                no,
                raw,
                ln,
                device=bus or m.group(2),
                bus_id=bus,
                severity=severity,
                type=m.group(4).strip(),
                driver=m.group(1),
            )
            self.last_pcie = (no, e)
            return True
        return "AER:" in msg and "pcieport" in msg  # detail lines of an AER report: not separate events

    def link(self, no: int, raw: str, ln: _Line, msg: str) -> bool:
        m = _MLX_PORT.match(msg)
        if m:
            state = {"ACTIVE": "up", "DOWN": "down"}.get(m.group(5), "init")
            self.add(
                "nic_link",
                no,
                raw,
                ln,
                device=m.group(3),
                state=state,
                driver=m.group(1),
                bus_id=normalize_bus_id(m.group(2)),
                port=int(m.group(4)),
                ib_state=m.group(5),
            )
            return True
        m = _MODULE_EVENT.search(msg)
        if m:
            cable = m.group(2).lower()
            drv = _DRIVER_DEV.match(msg)
            bus = normalize_bus_id(drv.group(2)) if drv else None
            self.add(
                "nic_link",
                no,
                raw,
                ln,
                device=bus,
                state="up" if cable == "plugged" else "down",
                driver=drv.group(1) if drv else None,
                bus_id=bus,
                module=int(m.group(1)),
                cable=cable,
            )
            return True
        m = _NIC_LINK.search(msg) or _LINK.search(msg)
        state = m.group(2).lower() if m else None
        if m is None:
            m = _LINK_READY.search(msg)
            state = "up" if m else None
        if m is None or state is None:
            return False
        dev = m.group(1).split("@", 1)[0]
        drv = _DRIVER_DEV.match(msg)
        self.add(
            "nic_link",
            no,
            raw,
            ln,
            device=dev,
            state=state,
            driver=drv.group(1) if drv else None,
            bus_id=normalize_bus_id(drv.group(2)) if drv else None,
        )
        return True

    def finish(self) -> None:
        # A bare "fallen off the bus" line only stands in for an Xid 79 the log does not have.
        drop = {id(e) for e in self.inferred if e.fields.get("bus_id") in self.xid79}
        if drop:  # one pass: list.remove() per event is quadratic on a log that repeats the pair
            self.ev.events[:] = [e for e in self.ev.events if id(e) not in drop]
        for host in sorted(self.hosts):
            self.ev.note_host(host)


def _aer_severity(text: str) -> str:
    if text.startswith("Corrected"):
        return "corrected"
    return "fatal" if "(Fatal)" in text else "nonfatal"


def _oom_sizes(tail: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in (("total-vm", "total_vm_kb"), ("anon-rss", "anon_rss_kb")):
        m = re.search(rf"{key}:(\d+)kB", tail)
        if m:
            out[name] = int(m.group(1))
    return out


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("NVRM: Xid", "kernel")
CLAIM_PATTERNS: tuple[str, ...] = (r"\[[^\[\]]*\.", r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ")


def claims(line: str) -> int:
    """How surely one line is the kernel log's (see probes/reader.py)."""
    if "NVRM: Xid" in line:
        return 9
    s = _stamped(line)
    if s == 2:
        return 8
    return 4 if s == 1 else 0
