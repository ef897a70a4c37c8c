"""Which parser reads an artifact: decided from its content, never its name.

Each artifact-kind module in probes/ exposes:
    KIND: str
    sniff(head: bytes) -> int     0 when the bytes are not this kind, else a score (higher = surer)
    parse(data: bytes, src: Source, ev: Evidence) -> None
and those whose lines the reader cuts into regions (probes/reader.py):
    claims(line: str) -> int      how surely one clean line is this kind's (REGION_CLAIM or more: it is)
    parse_lines(lines, src, ev)   a region of clean lines
    CLAIM_WORDS, CLAIM_PATTERNS   claims()'s needles, optional: every line claims() gives REGION_CLAIM or more
                                  holds one of the words or matches one of the patterns (Hyperscan syntax, `^` at
                                  a line's start); the reader asks claims() only about lines that do (one Hyperscan
                                  pass finds them all). tests/probes/test_claim_needles.py checks them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hangdx.probes.model import Evidence, Source
from hangdx.probes.text import looks_binary

_MODULES = [
    "pyspy",
    "procstate",
    "flight_recorder",
    "nccl_log",
    "nccl_error",
    "torch_log",
    "nvidia_smi",
    "kernel_log",
    "ibstat",
    "perfquery",
    "ip_link",
    "mpi_log",
    "app_log",
    "nccl_tests",
    "rank_timing",
    "pp_schedule",
    "gdb",
    "faulthandler",
    "pyspy_top",
    "ps_table",
    "horovod_log",
    "pystack",
    "p2p_bandwidth",
    "nvidia_smi_q",
    "dcgmi_diag",
    "ncclras",
    "gpu_topo",
]

HEAD_BYTES = 64 * 1024


def parsers() -> list[ModuleType]:
    out = []
    for name in _MODULES:
        try:
            out.append(importlib.import_module(f"hangdx.probes.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"hangdx.probes.{name}":
                raise
    return out


def detect(data: bytes) -> ModuleType | None:
    """The parser module whose sniff is surest of these bytes, or None."""
    head = data[:HEAD_BYTES]
    best, best_score = None, 0
    for mod in parsers():
        try:
            score = int(mod.sniff(head))
        except Exception:  # a sniff must never sink the whole analysis
            score = 0
        if score > best_score:
            best, best_score = mod, score
    return best


def parse_artifact(
    data: bytes, src: Source, ev: Evidence, kind: str | None = None, quiet: bool = False
) -> str | None:
    """Parse one artifact into ev; returns the kind read, or None (with a gap saying why).

    A dump (pickle, JSON) goes whole to its parser; any text goes through the one reader (probes/reader.py),
    which reads it as a sequence of regions of any kinds. The kind returned names the text by its main kind.
    """
    if not data.strip():
        ev.gap(src.name, "empty file: nothing to read")
        return None
    mod = None
    if kind:
        mod = next((m for m in parsers() if m.KIND == kind), None)
    if mod is None:
        mod = detect(data)
    from hangdx.probes import reader

    if not kind and not reader.is_dump(data[:64]) and not looks_binary(data[:HEAD_BYTES]):
        return _read_text(data, src, ev, mod, quiet)
    if mod is None:
        if quiet:
            return None
        what = "binary content" if looks_binary(data[:HEAD_BYTES]) else "text"
        ev.gap(src.name, f"not a known artifact ({what} of {len(data)} bytes): skipped")
        return None
    before = _size(ev)
    try:
        mod.parse(data, src, ev)
    except Exception as e:  # noqa: BLE001 - a bad file becomes a gap, never a traceback
        ev.gap(
            src.name, f"could not parse as {mod.KIND}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        )
        return None
    # A structured artifact that yields nothing was cut short, say: named, never silently dropped. A log with
    # nothing of note (a clean kernel log) is normal and says so by yielding nothing.
    if _size(ev) == before and not quiet and not getattr(mod, "QUIET_WHEN_EMPTY", False):
        ev.gap(src.name, f"read as {mod.KIND}, but nothing in its {len(data)} bytes is evidence hangdx uses")
    ev.note_host(src.host)
    return mod.KIND


def _read_text(data: bytes, src: Source, ev: Evidence, sniffed: ModuleType | None, quiet: bool) -> str | None:
    """A text through the reader; named by the kind its sniff chose when the reader read that kind too."""
    from hangdx.probes import reader

    before = _size(ev)
    report = reader.read_text([data], src, ev)
    kinds = [r.kind for r in report.regions if r.kind]
    if not kinds:
        if not quiet:
            what = "text"
            ev.gap(src.name, f"not a known artifact ({what} of {len(data)} bytes): skipped")
        return None
    family = {reader.family(k) for k in kinds}
    if sniffed is not None and reader.family(sniffed.KIND) in family:
        name = sniffed.KIND
    else:
        name = max(set(kinds), key=lambda k: sum(r.lines for r in report.regions if r.kind == k))
        # The reader names PyTorch's and NCCL's lines by their shared family; a text too short for either sniff
        # (a torchrun log cut in its second line) with no NCCL line in it is PyTorch's.
        if name == "nccl_log" and b"NCCL" not in data[:HEAD_BYTES]:
            name = "torch_log"
    loud = [m.KIND for m in parsers() if m.KIND in kinds and not getattr(m, "QUIET_WHEN_EMPTY", False)]
    if _size(ev) == before and not quiet and loud:
        what = name if len(family) == 1 else " and ".join(sorted(set(kinds)))
        ev.gap(src.name, f"read as {what}, but nothing in its {len(data)} bytes is evidence hangdx uses")
    ev.note_host(src.host)
    return name


def _size(ev: Evidence) -> tuple:
    """How much ev holds: a parser that adds nothing leaves it unchanged (pids joined to GPUs count)."""
    lists = (ev.stacks, ev.processes, ev.collectives, ev.events, ev.gpus, ev.ib_ports, ev.links, ev.gaps)
    return (*map(len, lists), sum(len(g.pids) for g in ev.gpus), ev.job_id, ev.world_size)
