"""InfiniBand port counters: `perfquery` and `perfquery -x` (infiniband-diags / rdma-core).

    # Port counters: Lid 12 port 1 (CapMask: 0x5A00)
    PortSelect:......................1
    CounterSelect:...................0x0000
    SymbolErrorCounter:..............0
    LinkErrorRecoveryCounter:........0
    ...
    # Port extended counters: Lid 12 port 1 (CapMask: 0x5A00 CapMask2: 0x0000000)
    PortXmitData:....................13672645927
    ...

One IbPort per block, `counters` named exactly as perfquery prints them (PortSelect,
CounterSelect and CounterSelect2 are selectors, not counters, and are left out; hex values
are read as numbers). A file may hold several blocks: several ports, or the same port sampled
twice seconds apart, which is how a playbook sees error counters rising.

hangdx's collector writes a marker line before each sample:

    # hangdx sample <unix-time> [ca=<name>] [port=<n>] [host=<h>]

which sets the next blocks' sampled_at (and ca, port, host when given). Without a marker,
ca is f"lid{lid}" and sampled_at is the block's index among the blocks of the same
(lid, port): 0.0, 1.0, ... so "the later sample" still sorts after the earlier one.
`ibwarn:`/`iberror:` lines (a port that could not be queried) become gaps.
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, IbPort, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines

KIND = "perfquery"

# Numbers are bounded ({1,9}: a lid or port; a counter is 64 bits): int() of 5000 digits raises.
_HEADER = lazy(r"^# Port (?:extended )?counters: Lid (\d{1,9}) (?:port (\d{1,9})|all ports)")
_MARKER = lazy(r"^# hangdx sample (\S+)(.*)$")
_KV = lazy(r"(?<!\w)(\w+)=(\S+)")
_PORT = lazy(r"\d{1,9}")
_COUNTER = lazy(r"^([A-Za-z][A-Za-z0-9]*):\.+\s*(0x[0-9A-Fa-f]{1,16}|\d{1,20})\s*$")
_FAILURE = lazy(r"^(?:ibwarn|iberror|perfquery): .*")
_SELECTORS = {"PortSelect", "CounterSelect", "CounterSelect2"}
_KNOWN = ("SymbolErrorCounter", "PortXmitData", "PortRcvData", "LinkDownedCounter", "PortXmitWait")


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    if re.search(r"^# Port (?:extended )?counters: Lid \d+", text, re.M):
        return 95
    if re.search(r"^# hangdx sample \S+", text, re.M):
        return 90
    if sum(1 for ln in text.splitlines() if _COUNTER.match(ln)) >= 5 and any(k in text for k in _KNOWN):
        return 40
    if re.search(r"^perfquery: iberror: ", text, re.M):
        return 60  # perfquery's own failure: read so that it becomes a gap naming the port
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    marker: dict[str, str] = {}
    marker_time: float | None = None
    block: IbPort | None = None
    seen: dict[tuple[int | None, int], int] = {}  # blocks so far per (lid, port)

    def start(lid: int | None, port: int, q: Quote) -> IbPort:
        if _PORT.fullmatch(marker.get("port", "")):
            port = int(marker["port"])
        key = (lid, port)
        index = seen.get(key, 0)
        seen[key] = index + 1
        ca = marker.get("ca") or (f"lid{lid}" if lid is not None else "unknown")
        sampled = marker_time if marker_time is not None else float(index)
        p = IbPort(host=marker.get("host") or src.host, ca=ca, port=port, sampled_at=sampled, quote=q)
        ev.ib_ports.append(p)
        return p

    for no, raw in numbered:
        line = raw.strip()
        if not line:
            continue
        q = Quote(src.name, no, raw)
        if m := _MARKER.match(line):
            marker = dict(_KV.findall(m.group(2)))
            try:
                marker_time = float(m.group(1))
            except ValueError:
                marker_time = None
            block = None
        elif (m := _HEADER.match(line)) is not None:
            lid = int(m.group(1))
            port = int(m.group(2)) if m.group(2) else 255  # perfquery's "all ports" selector
            block = start(lid, port, q)
        elif (m := _COUNTER.match(line)) is not None:
            if block is None:  # counters without a header: a cut-off file; keep them, port unknown
                block = start(None, 0, q)
            name, value = m.group(1), m.group(2)
            if name not in _SELECTORS:
                block.counters[name] = int(value, 16) if value.startswith("0x") else int(value)  # "007" too
        elif _FAILURE.match(line):
            ev.gap(src.name, line)


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("# Port ", "# hangdx sample", "perfquery: iberror: ", "...")
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is perfquery's (see probes/reader.py)."""
    if line.startswith("# Port ") and "counters: Lid" in line:
        return 10
    if line.startswith(("# hangdx sample", "perfquery: iberror: ")):
        return 9
    if "..." in line and _COUNTER.match(line):
        return 6
    return 0
