"""`nvidia-smi -q` (`-a`): the long per-GPU report, whole or in the pieces people grep out of it.

The report, as drivers 410 to 580 print it (key widths differ, the layout does not):

    ==============NVSMI LOG==============
    Attached GPUs                             : 8
    GPU 00000000:10:1C.0
        Product Name                          : NVIDIA A100-SXM4-80GB
        GPU UUID                              : GPU-...
        Clocks Event Reasons                  (`Clocks Throttle Reasons` before driver 535)
            HW Slowdown                       : Active
                HW Thermal Slowdown           : Not Active
        FB Memory Usage / Utilization / GPU Power Readings / Processes
        ECC Errors
            Volatile
                SRAM Uncorrectable            : 1       (`Double Bit` > `Total` before Ampere)
        Retired Pages
            Pending Page Blacklist            : Yes     (`Pending : Yes` on newer drivers)
        Remapped Rows
            Pending                           : Yes
            Remapping Failure Occurred        : No
        GPU Reset Status                      (until 550; 580 prints `GPU Recovery Action : None` instead)
            Reset Required                    : No
        GPU Power Readings
            Power Draw                        : 21.30 W   (580: `Average Power Draw`, `Instantaneous Power Draw`)
            Current Power Limit               : 150.00 W

Sections nest by indentation; a key is read with the sections above it, so `Pending` under `Remapped
Rows` is a pending row remap and under `Retired Pages` a pending page retirement.

Records: one GpuState per `GPU <bus id>` block (name, uuid, utilisation, memory, power, the PIDs of its
Processes section). What NVIDIA's memory-error and debug guides call a fault becomes a LogEvent
"gpu_memory_error" (bus_id, uuid, problem, meaning, action, severity), quoting the line that says it:
uncorrectable ECC errors in the volatile counters (this boot; the aggregate counters are the GPU's
history and only add to the words), a pending or failed row remap, a page pending retirement, a reset
required, a `GPU Recovery Action` other than None (Reset, Reboot, Drain P2P, Drain and Reset). A GPU whose
clocks are held down by hardware (HW Slowdown, HW Thermal / Power Brake Slowdown, SW Thermal Slowdown Active)
becomes a LogEvent "gpu_throttled" (bus_id, uuid, reasons). A piece with no `GPU <bus id>` line above it yields
the same events without a bus id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hangdx.probes.model import Evidence, GpuState, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines
from hangdx.probes.xid import normalize_bus_id

KIND = "nvidia_smi_q"
QUIET_WHEN_EMPTY = True  # a healthy GPU's report, or a piece of one, has nothing to say

_BANNER = lazy(r"^=+NVSMI LOG=+$")
_ATTACHED = lazy(r"^Attached GPUs\s*:\s*(\d{1,4})\s*$")
_GPU = lazy(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
# `Key    : Value`; a key is words, with the dots, dashes and slashes NVIDIA puts in them (`GPU T.Limit Temp`,
# `SEC-DED`, `Page Retirement/Row Remap`). Bounded runs: linear on any line.
_KV = lazy(r"^(\S[^:]{0,80}?)\s{0,80}: (.{0,400})$")
_SECTION = lazy(r"^[A-Za-z][A-Za-z0-9 ./()\-]{0,60}$")
_NUMBER = lazy(r"^(\d{1,15}(?:\.\d{1,6})?)")

_SECTIONS = {
    "ecc errors",
    "retired pages",
    "remapped rows",
    "clocks throttle reasons",
    "clocks event reasons",
    "gpu reset status",
    "fb memory usage",
    "bank remap availability histogram",
}
_SECTION_FIRST = {k.split()[0] for k in _SECTIONS}  # a section's first word: the cheap test of every line
_KEYS = {
    "pending page blacklist",
    "remapping failure occurred",
    "sram uncorrectable",
    "dram uncorrectable",
    "hw slowdown",
    "hw thermal slowdown",
    "hw power brake slowdown",
    "sw thermal slowdown",
    "product name",
    "gpu uuid",
    "reset required",
    "drain and reset recommended",
    "gpu recovery action",
}
# `GPU Power Readings`: drivers up to 550 print one `Power Draw`; later ones (580 here) print `Average Power Draw`
# and `Instantaneous Power Draw` instead. The average comes first, as `--query-gpu=power.draw` (the 1 s average on
# Ampere and later) would give it. The limit in force is `Current Power Limit` (`Enforced Power Limit` on older drivers).
_POWER_DRAW = ("power draw", "average power draw", "instantaneous power draw")
_POWER_LIMIT = ("current power limit", "enforced power limit")
# `GPU Recovery Action` (a top-level key of recent drivers' reports, 580 here, in place of `GPU Reset Status`): the
# action NVML_FI_DEV_GET_GPU_RECOVERY_ACTION asks for after an uncorrectable error, as NVIDIA's GPU memory error
# management guide ("Error Recovery and Response Flags") names them. `None` (and N/A) asks for nothing.
_RECOVERY = {
    "reset": "recovery_reset",
    "reboot": "recovery_reboot",
    "drain p2p": "recovery_drain_p2p",
    "drain and reset": "recovery_drain_and_reset",
}
_THROTTLE = ("hw slowdown", "hw thermal slowdown", "hw power brake slowdown", "sw thermal slowdown")

# problem -> (meaning, action, severity); words from NVIDIA's GPU memory error management and debug guides
_PROBLEMS = {
    "uncorrectable_ecc": (
        "uncorrectable ECC errors in GPU memory since the driver loaded",
        "Drain the node and reset the GPU (nvidia-smi -r) or reboot; RMA the GPU if they recur.",
        "critical",
    ),
    "row_remap_failure": (
        "a row remapping failed: the GPU can no longer replace its bad memory rows",
        "Drain the node and run the field diagnostic; the GPU qualifies for RMA.",
        "critical",
    ),
    "row_remap_pending": (
        "a memory row remap is pending and takes effect only after a GPU reset",
        "Reset the GPU (nvidia-smi -r) or reboot the node so that the remap takes effect.",
        "error",
    ),
    "page_retirement_pending": (
        "a memory page is pending retirement (blacklist) until the GPU is reset",
        "Reset the GPU (nvidia-smi -r) or reboot the node so that the page is retired.",
        "error",
    ),
    "reset_required": (
        "the driver says the GPU needs a reset after an unrecoverable error",
        "Drain the node and reset the GPU (nvidia-smi -r) or reboot it.",
        "error",
    ),
    "recovery_reset": (
        "the driver's recovery action is Reset: the GPU hit a fault that only a GPU reset recovers from",
        "Stop every process on the GPU, reset it (nvidia-smi -r), then start new processes.",
        "error",
    ),
    "recovery_reboot": (
        "the driver's recovery action is Reboot: a GPU fault may have left the OS in an inconsistent state",
        "Drain the node and reboot it.",
        "critical",
    ),
    "recovery_drain_p2p": (
        "the driver's recovery action is Drain P2P: a GPU fault requires all peer-to-peer traffic to be quiesced",
        "Stop the processes that use peer-to-peer traffic on this GPU, then query the recovery action again.",
        "error",
    ),
    "recovery_drain_and_reset": (
        "the driver's recovery action is Drain and Reset: a GPU fault requires peer-to-peer traffic drained and a reset",
        "Drain the node, stop every process on the GPU and reset it (nvidia-smi -r) or reboot.",
        "error",
    ),
}


def _key(text: str) -> str:
    return " ".join(text.split()).lower()


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    rows = [ln.strip() for ln in text.splitlines()[:3000] if ln.strip()]
    if any(_BANNER.match(r) for r in rows[:50]):
        return 95
    if any(_ATTACHED.match(r) for r in rows) and any(_GPU.match(r) for r in rows):
        return 90
    sections = sum(1 for r in rows if _key(r) in _SECTIONS)
    keys = sum(1 for r in rows if (m := _KV.match(r)) and _key(m.group(1)) in _KEYS)
    if sections and keys:
        return 75
    return 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("NVSMI LOG", "Attached GPUs", "GPU ", " : ")
CLAIM_PATTERNS: tuple[str, ...] = (r"(?i)ecc|retired|remapped|reasons|status|memory|histogram",)


def claims(line: str) -> int:
    """How surely one line is `nvidia-smi -q`'s (see probes/reader.py)."""
    s = line.strip()
    if not s or len(s) > 500:
        return 0
    if "NVSMI LOG" in s and _BANNER.match(s):
        return 10
    if s.startswith("Attached GPUs") and _ATTACHED.match(s):
        return 9
    if s.startswith("GPU ") and _GPU.match(s):
        return 8
    if s.split(None, 1)[0].lower() in _SECTION_FIRST and _key(s) in _SECTIONS:
        return 7
    if " : " in s and line[:1] in (" ", "\t"):
        m = _KV.match(s)
        if m and _key(m.group(1)) in _KEYS:
            return 6
    return 0


@dataclass
class _Block:
    """One `GPU <bus id>` block (or a piece with none) being read."""

    bus_id: str | None
    quote: Quote | None
    gpu: GpuState | None
    uuid: str | None = None
    problems: list[tuple[str, Quote, dict[str, Any]]] = field(default_factory=list)
    throttles: list[tuple[str, Quote]] = field(default_factory=list)
    aggregate_unc: int = 0


class _Parser:
    def __init__(self, src: Source, ev: Evidence) -> None:
        self.src, self.ev = src, ev
        self.stack: list[tuple[int, str]] = []  # (indent, section name, lower-case)
        self.block = _Block(None, None, None)
        self.blocks: list[_Block] = [self.block]
        self.attached: int | None = None

    def quote(self, no: int, raw: str) -> Quote:
        return Quote(self.src.name, no, raw)

    def line(self, no: int, raw: str) -> None:
        s = raw.strip()
        if not s:
            return
        if _BANNER.match(s):
            return
        m = _ATTACHED.match(s)
        if m:
            self.attached = int(m.group(1))
            return
        indent = len(raw) - len(raw.lstrip())
        m = _GPU.match(s)
        if m:
            bus = normalize_bus_id(m.group(1))
            gpu = GpuState(host=self.src.host, index=None, bus_id=bus, quote=self.quote(no, raw))
            self.block = _Block(bus, gpu.quote, gpu)
            self.blocks.append(self.block)
            self.stack = []
            return
        while self.stack and self.stack[-1][0] >= indent:
            self.stack.pop()
        kv = _KV.match(s)
        if kv is None:
            if _SECTION.match(s):
                self.stack.append((indent, _key(s)))
            return
        self.value(no, raw, [name for _, name in self.stack], _key(kv.group(1)), kv.group(2).strip())

    def value(self, no: int, raw: str, path: list[str], key: str, value: str) -> None:
        b, gpu = self.block, self.block.gpu
        low = value.lower()
        where = path[-1] if path else ""
        if key == "product name" and gpu is not None:
            gpu.name = value
        elif key == "gpu uuid" and value.startswith(("GPU-", "MIG-")):
            b.uuid = value
            if gpu is not None:
                gpu.uuid = value
        elif where == "utilization" and key == "gpu" and gpu is not None:
            gpu.util_pct = _num(value)
        elif where == "fb memory usage" and key in ("total", "used") and gpu is not None:
            setattr(gpu, "mem_total_mib" if key == "total" else "mem_used_mib", _num(value))
        elif where.endswith("power readings") and key in _POWER_DRAW and gpu is not None:
            if gpu.power_w is None and not where.startswith(("gpu memory", "module")):
                gpu.power_w = _num(value)
        elif where.endswith("power readings") and key in _POWER_LIMIT and gpu is not None:
            if gpu.power_limit_w is None and not where.startswith(("gpu memory", "module")):
                gpu.power_limit_w = _num(value)
        elif key == "gpu recovery action" and not path:
            problem = _RECOVERY.get(_key(value))
            if problem is not None:
                b.problems.append((problem, self.quote(no, raw), {"recovery_action": value}))
        elif key == "process id" and "processes" in path and gpu is not None:
            n = _num(value)
            if n is not None and int(n) not in gpu.pids:
                gpu.pids.append(int(n))
        elif "ecc errors" in path:
            self.ecc(no, raw, path, key, value)
        elif where == "retired pages" and key in ("pending page blacklist", "pending") and low == "yes":
            b.problems.append(("page_retirement_pending", self.quote(no, raw), {}))
        elif where == "remapped rows":
            if key == "pending" and low == "yes":
                b.problems.append(("row_remap_pending", self.quote(no, raw), {}))
            elif key == "remapping failure occurred" and low == "yes":
                b.problems.append(("row_remap_failure", self.quote(no, raw), {}))
        elif where == "gpu reset status" and key in ("reset required", "drain and reset recommended"):
            if low == "yes":
                b.problems.append(("reset_required", self.quote(no, raw), {}))
        elif where in ("clocks throttle reasons", "clocks event reasons") and key in _THROTTLE:
            if low == "active":
                b.throttles.append((key, self.quote(no, raw)))

    def ecc(self, no: int, raw: str, path: list[str], key: str, value: str) -> None:
        """An uncorrectable counter: `SRAM/DRAM Uncorrectable [...]` (Ampere on), `Double Bit` > `Total` before."""
        uncorrectable = (
            key.startswith(("sram uncorrectable", "dram uncorrectable")) and "sources" not in path[-1]
        ) or ("double bit" in path and key == "total")
        n = _num(value)
        if not uncorrectable or not n:
            return
        if "volatile" in path:
            where = key.split()[0].upper() if key != "total" else "double-bit"
            self.block.problems.append(
                ("uncorrectable_ecc", self.quote(no, raw), {"count": int(n), "memory": where})
            )
        elif "aggregate" in path:
            self.block.aggregate_unc += int(n)

    def finish(self) -> None:
        gpu_blocks = [b for b in self.blocks if b.gpu is not None]
        if self.attached is not None and len(gpu_blocks) == self.attached:
            for i, b in enumerate(gpu_blocks):  # -q lists every GPU, in nvidia-smi's index order
                if b.gpu is not None:
                    b.gpu.index = i
        for b in self.blocks:
            if b.gpu is not None:
                self.ev.gpus.append(b.gpu)
            self.events(b)

    def events(self, b: _Block) -> None:
        seen: set[str] = set()
        ecc = [f for p, _, f in b.problems if p == "uncorrectable_ecc"]
        for problem, quote, extra in b.problems:
            if problem in seen:
                continue
            seen.add(problem)
            meaning, action, severity = _PROBLEMS[problem]
            if problem == "uncorrectable_ecc":
                counts = ", ".join(f"{f['count']} {f['memory']}" for f in ecc)
                meaning = f"{counts} uncorrectable ECC error{'s' if sum(f['count'] for f in ecc) != 1 else ''} since the driver loaded"
                if b.aggregate_unc:
                    meaning += f" ({b.aggregate_unc} in the GPU's lifetime)"
            fields = {
                "bus_id": b.bus_id,
                "uuid": b.uuid,
                "problem": problem,
                "meaning": meaning,
                "action": action,
                "severity": severity,
                **extra,
            }
            self.event("gpu_memory_error", quote, fields)
        if b.throttles:
            reasons = list(dict.fromkeys(k for k, _ in b.throttles))
            fields = {"bus_id": b.bus_id, "uuid": b.uuid, "reasons": reasons}
            self.event("gpu_throttled", b.throttles[-1][1], fields)

    def event(self, kind: str, quote: Quote, fields: dict[str, Any]) -> None:
        fields = {k: v for k, v in fields.items() if v is not None}
        self.ev.events.append(LogEvent(kind, quote, host=self.src.host, rank=self.src.rank, fields=fields))


def _num(value: str) -> float | None:
    m = _NUMBER.match(value.strip())
    return float(m.group(1)) if m else None


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    p = _Parser(src, ev)
    for no, raw in numbered:
        try:
            p.line(no, raw)
        except ValueError:  # a mangled number is skipped, never fatal
            continue
    p.finish()
