"""nvidia-smi: the default table, `--query-gpu`/`--query-compute-apps` CSV, and its failure messages.

The table, as drivers 470 to 580 print it (column widths differ, the rows do not):

    |   0  NVIDIA H100 80GB HBM3          On  | 00000000:04:00.0 Off |                    0 |
    | N/A   36C    P0             113W / 700W |  72459MiB / 81559MiB |    100%      Default |
    ...
    |    0   N/A  N/A    123456      C   python                                72440MiB |   (Processes)

CSV (`--format=csv`, with or without `nounits`), columns mapped by the header:

    index, uuid, pci.bus_id, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB], power.draw [W]
    pid, process_name, gpu_uuid, gpu_bus_id, used_gpu_memory [MiB]

Headerless rows (`noheader`) are read only when their shape is unmistakable: the --query-gpu
order above (index, GPU-uuid, bus id, ...) or the --query-compute-apps order above (pid, name,
GPU-uuid, bus id, memory); anything else is skipped with a gap.

Records: one GpuState per GPU (bus id as `0000:3b:00.0`); PIDs from the Processes section or the
compute-apps CSV attach to their GpuState. A compute app whose GPU is in no GpuState (yet) becomes
a LogEvent "gpu_process" (pid, process_name, gpu_uuid, gpu_bus_id, used_memory_mib); GPU tables
parsed later pick those up. Failures: "nvidia_smi_failed" (driver unreachable, NVML init failed,
no devices), "gpu_lost" (bus_id, gpu_index, reason) and "gpu_error" (index, bus_id, columns: the
fields that read ERR! or [Unknown Error]).
"""

from __future__ import annotations

import re
from typing import Any

from hangdx.probes.model import Evidence, GpuState, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines
from hangdx.probes.xid import normalize_bus_id

KIND = "nvidia_smi"

_BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]"
_UUID = lazy(r"^(?:GPU|MIG)-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_BUS_RE = lazy(rf"^{_BUS}$")

_HEADER = lazy(r"NVIDIA-SMI \S+\s+Driver Version: (\S+)")
# Captures start and end on a non-space: a lazy `.+?` between `\s+` runs is quadratic on long lines.
_ROW1 = lazy(r"^\s*(\d+)\s+(\S(?:.*\S)?)\s+(On|Off)\s*$")
_ROW1_BUS = lazy(rf"^\s*({_BUS})\s+(\S+)\s*$")
# (?<!..): a search starts at the first digit of a number only (linear on a long run of digits)
_POWER = lazy(r"(?<![\d.])(\d{1,9}(?:\.\d{1,6})?)W\s*/\s*(?:(\d{1,9}(?:\.\d{1,6})?)W|N/A)")
_MEM = lazy(r"(?<!\d)(\d{1,12})MiB\s*/\s*(\d{1,12})MiB")
_UTIL = lazy(r"^\s*(\d{1,9})%")
_PROC = lazy(
    r"^\s*(\d+)\s+(?:(N/A|\d+)\s+(N/A|\d+)\s+)?(\d+)\s+(C\+G|M\+C|C|G|M)(?:\s+(\S(?:.*\S)?))??\s+(\d+MiB|N/A)\s*$"
)

_FAILED = lazy(
    r"NVIDIA-SMI has failed because (.*)|Failed to initialize NVML: (.*)|^(No devices were found)\s*$"
)
# (Each of _FAILED's messages holds `No ` at its start, `NVIDIA-SMI` or `NVML`: claims looks for them first.)
_LOST = lazy(rf"Unable to determine the device handle for (?:GPU|gpu)\s*(\d+)?:?\s*({_BUS}):\s*(.*)$")

_UNIT = lazy(r"(?<!\s)\s*\[[^\[\]]*\]$")  # " [MiB]" after a CSV column name
_ERRORS = ("ERR!", "[Unknown Error]", "[GPU is lost]", "[GPU requires reset]", "Unknown Error")
_KEYS = {
    "index": "index",
    "uuid": "uuid",
    "gpu_uuid": "uuid",
    "pci.bus_id": "bus_id",
    "gpu_bus_id": "bus_id",
    "name": "name",
    "gpu_name": "name",
    "utilization.gpu": "util_pct",
    "memory.used": "mem_used_mib",
    "memory.total": "mem_total_mib",
    "power.draw": "power_w",
    "power.draw.instant": "power_w",
    "power.draw.average": "power_w",
    "power.limit": "power_limit_w",
    "enforced.power.limit": "power_limit_w",
    "pid": "pid",
    "process_name": "process_name",
    "used_gpu_memory": "used_memory_mib",
    "used_memory": "used_memory_mib",
}
_GPU_COLUMNS = ["index", "uuid", "bus_id", "name", "util_pct", "mem_used_mib", "mem_total_mib", "power_w"]
_APP_COLUMNS = ["pid", "process_name", "uuid", "bus_id", "used_memory_mib"]


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    if _HEADER.search(text):
        return 95
    rows = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if any(_csv_header(ln) for ln in rows[:50]):
        return 90
    if any(_is_table_row1(ln) for ln in rows[:200]):
        return 85
    short = len(rows) <= 30  # failure output is a line or two, not buried in another log
    if short and any(_FAILED.search(ln) or _LOST.search(ln) for ln in rows):
        return 85
    if short and any(_headerless(ln) for ln in rows):
        return 70
    return 0


def _is_table_row1(line: str) -> bool:
    cells = _cells(line)
    return len(cells) >= 3 and bool(_ROW1.match(cells[0]) and _ROW1_BUS.match(cells[1]))


def _cells(line: str) -> list[str]:
    s = line.strip()
    if not (s.startswith("|") and s.endswith("|")):
        return []
    return s[1:-1].split("|")


def _csv_header(line: str) -> list[str] | None:
    """The field keys of an nvidia-smi CSV header line, or None."""
    if "," not in line:
        return None
    names = [_UNIT.sub("", p.strip()) for p in line.split(",")]
    if not all(re.fullmatch(r"[a-z][a-z0-9_.]*", n) for n in names):
        return None
    keys = [_KEYS.get(n, "") for n in names]
    if sum(1 for k in keys if k) < 2 and not any(
        n in ("index", "pid", "pci.bus_id", "gpu_uuid") for n in names
    ):
        return None
    return keys


def _headerless(line: str) -> list[str] | None:
    """The column keys of a `noheader` CSV row whose shape is unmistakable, or None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) >= 3 and parts[0].isdigit() and _UUID.match(parts[1]) and _BUS_RE.match(parts[2]):
        return _GPU_COLUMNS[: len(parts)] if len(parts) <= len(_GPU_COLUMNS) else None
    if len(parts) == 5 and parts[0].isdigit() and _UUID.match(parts[2]) and _BUS_RE.match(parts[3]):
        return _APP_COLUMNS
    return None


def _number(value: str) -> tuple[float | None, bool]:
    """A CSV/table value as a number (units dropped); second item True when it reads as an error."""
    v = value.strip()
    if any(v.startswith(e) for e in _ERRORS):
        return None, True
    m = re.match(r"^(-?\d{1,15}(?:\.\d{1,9})?)(?!\d)", v)
    return (float(m.group(1)), False) if m else (None, False)


class _Parser:
    def __init__(self, src: Source, ev: Evidence) -> None:
        self.src, self.ev = src, ev
        self.gpus: list[GpuState] = []
        self.apps: list[tuple[dict[str, Any], Quote]] = []
        self.table_gpu: GpuState | None = None  # the GPU whose second table row comes next
        self.table_errors: list[str] = []
        self.in_processes = False
        self.csv_keys: list[str] | None = None
        self.skipped = 0  # CSV rows without a header whose columns cannot be told apart

    def quote(self, no: int, raw: str) -> Quote:
        return Quote(self.src.name, no, raw)

    def event(self, kind: str, no: int, raw: str, pid: int | None = None, **fields: Any) -> None:
        fields = {k: v for k, v in fields.items() if v is not None}
        e = LogEvent(
            kind, self.quote(no, raw), host=self.src.host, rank=self.src.rank, pid=pid, fields=fields
        )
        self.ev.events.append(e)

    def line(self, no: int, raw: str) -> None:
        s = raw.strip()
        if not s:
            self.csv_keys = None
            return
        m = _FAILED.search(s)
        if m:
            reason = next(g for g in m.groups() if g)
            self.event("nvidia_smi_failed", no, raw, reason=reason.strip())
            return
        m = _LOST.search(s)
        if m:
            self.event(
                "gpu_lost",
                no,
                raw,
                bus_id=normalize_bus_id(m.group(2)),
                gpu_index=int(m.group(1)) if m.group(1) else None,
                reason=m.group(3).strip(),
            )
            return
        if s.startswith("|") or s.startswith("+"):
            self.table(no, raw, s)
            return
        keys = _csv_header(s)
        if keys is not None:
            self.csv_keys = keys
            return
        keys = self.csv_keys or _headerless(s)
        if keys:
            self.csv_row(no, raw, s, keys)
        elif s.count(",") >= 2:
            self.skipped += 1

    def table(self, no: int, raw: str, s: str) -> None:
        if s.startswith("+"):
            return
        if "Processes:" in s:
            self.in_processes = True
            return
        cells = _cells(s)
        if self.in_processes:
            if len(cells) == 1:
                m = _PROC.match(cells[0])
                if m:
                    self.process_row(no, raw, m)
            return
        if len(cells) < 3:
            return
        m1, m2 = _ROW1.match(cells[0]), _ROW1_BUS.match(cells[1])
        if m1 and m2:
            self.finish_table_gpu()
            gpu = GpuState(
                host=self.src.host,
                index=int(m1.group(1)),
                bus_id=normalize_bus_id(m2.group(1)),
                name=m1.group(2).strip(),
                quote=self.quote(no, raw),
            )
            self.gpus.append(gpu)
            self.table_gpu = gpu
            self.table_errors = ["name/bus"] if "ERR!" in s else []
            return
        gpu = self.table_gpu
        if (
            gpu is None
            or gpu.mem_total_mib is not None
            or not _MEM.search(cells[1])
            and "ERR!" not in cells[1]
        ):
            return
        # The second row of the GPU: fan/temp/perf/power | memory | util/compute mode
        p = _POWER.search(cells[0])
        gpu.power_w = float(p.group(1)) if p else None
        gpu.power_limit_w = float(p.group(2)) if p and p.group(2) else None
        mem = _MEM.search(cells[1])
        if mem:
            gpu.mem_used_mib, gpu.mem_total_mib = float(mem.group(1)), float(mem.group(2))
        u = _UTIL.match(cells[2])
        gpu.util_pct = float(u.group(1)) if u else None
        for name, cell in (("power", cells[0]), ("memory", cells[1]), ("util", cells[2])):
            if "ERR!" in cell:
                self.table_errors.append(name)
        if self.table_errors:
            self.event(
                "gpu_error",
                no,
                raw,
                index=gpu.index,
                bus_id=gpu.bus_id,
                columns=list(self.table_errors),
            )
        self.table_gpu = None

    def finish_table_gpu(self) -> None:
        self.table_gpu = None
        self.table_errors = []

    def process_row(self, no: int, raw: str, m: re.Match[str]) -> None:
        index, pid = int(m.group(1)), int(m.group(4))
        mem, _ = _number(m.group(7))
        app = {"pid": pid, "process_name": (m.group(6) or "").strip(), "index": index, "used_memory_mib": mem}
        self.apps.append((app, self.quote(no, raw)))

    def csv_row(self, no: int, raw: str, s: str, keys: list[str]) -> None:
        parts = [p.strip() for p in s.split(",")]
        if len(parts) != len(keys):
            return  # a truncated or foreign line
        row = dict(zip(keys, parts, strict=True))
        row.pop("", None)
        if "pid" in keys:
            self.app_row(no, raw, row)
            return
        if "index" not in row and "bus_id" not in row and "uuid" not in row:
            return
        bad = []
        gpu = GpuState(host=self.src.host, index=None, quote=self.quote(no, raw))
        for key, value in row.items():
            if key == "index":
                gpu.index = int(value) if value.isdigit() else None
            elif key == "uuid":
                gpu.uuid = value if _UUID.match(value) else None
            elif key == "bus_id":
                gpu.bus_id = normalize_bus_id(value)
            elif key == "name":
                gpu.name = value
            else:
                num, err = _number(value)
                setattr(gpu, key, num)
                if err:
                    bad.append(key)
        self.gpus.append(gpu)
        if bad:
            self.event("gpu_error", no, raw, index=gpu.index, bus_id=gpu.bus_id, columns=bad)

    def app_row(self, no: int, raw: str, row: dict[str, str]) -> None:
        pid = row.get("pid", "")
        if not pid.isdigit():
            return
        mem, _ = _number(row.get("used_memory_mib", ""))
        app = {
            "pid": int(pid),
            "process_name": row.get("process_name"),
            "uuid": row.get("uuid") if _UUID.match(row.get("uuid", "")) else None,
            "bus_id": normalize_bus_id(row.get("bus_id")),
            "used_memory_mib": mem,
        }
        self.apps.append((app, self.quote(no, raw)))

    def finish(self) -> None:
        if self.skipped and not self.gpus and not self.apps:
            self.ev.gap(
                self.src.name,
                f"{self.skipped} nvidia-smi CSV rows without a header: columns unknown, skipped",
            )
        self.ev.gpus.extend(self.gpus)
        host_gpus = [g for g in self.ev.gpus if g.host == self.src.host]
        for app, quote in self.apps:
            gpu = _match(host_gpus, self.gpus, app)
            if gpu is not None:
                if app["pid"] not in gpu.pids:
                    gpu.pids.append(app["pid"])
                continue
            fields = {
                "pid": app["pid"],
                "process_name": app.get("process_name"),
                "gpu_uuid": app.get("uuid"),
                "gpu_bus_id": app.get("bus_id"),
                "gpu_index": app.get("index"),
                "used_memory_mib": app.get("used_memory_mib"),
            }
            fields = {k: v for k, v in fields.items() if v is not None}
            e = LogEvent(
                "gpu_process", quote, host=self.src.host, rank=self.src.rank, pid=app["pid"], fields=fields
            )
            self.ev.events.append(e)
        # compute apps read earlier from another file join the GPUs read now
        for e in self.ev.events_of("gpu_process"):
            if e.host != self.src.host or e.quote.source == self.src.name:
                continue
            app = {"uuid": e.fields.get("gpu_uuid"), "bus_id": e.fields.get("gpu_bus_id")}
            gpu = _match(self.gpus, [], app)
            if gpu is not None and e.pid is not None and e.pid not in gpu.pids:
                gpu.pids.append(e.pid)


def _match(gpus: list[GpuState], same_file: list[GpuState], app: dict[str, Any]) -> GpuState | None:
    """The GPU an app runs on: by uuid, else bus id, else (same table only) index."""
    for g in gpus:
        if app.get("uuid") and g.uuid == app["uuid"]:
            return g
    for g in gpus:
        if app.get("bus_id") and g.bus_id == app["bus_id"]:
            return g
    if app.get("index") is not None:
        for g in same_file:
            if g.index == app["index"]:
                return g
    return None


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    p = _Parser(src, ev)
    for no, raw in numbered:
        try:
            p.line(no, raw)
        except ValueError:  # a mangled line (a number of 5000 digits, say) is skipped, never fatal
            continue
    p.finish()


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("NVIDIA-SMI", "|", "+-", ",", "No ", "NVML", "Unable to determine the device handle for ")
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is nvidia-smi's (see probes/reader.py)."""
    s = line.strip()
    if not s:
        return 0
    if "NVIDIA-SMI" in s and _HEADER.search(s):
        return 10
    if s.startswith("|") and _is_table_row1(s):
        return 8
    if s.startswith("+-") and s.endswith("+") and set(s) <= {"+", "-", "=", "|", " "}:
        return 6
    if "," in s and _csv_header(s):
        return 8
    if (s.startswith("No ") or "NVIDIA-SMI" in s or "NVML" in s) and _FAILED.search(s):
        return 8
    return 8 if _LOST.search(s) else 0
