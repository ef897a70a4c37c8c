"""CUDA samples' p2pBandwidthLatencyTest output: its devices, peer access and bandwidth/latency matrices.

As the sample prints it (cuda-samples 1_Utilities/ or 5_Domain_Specific/p2pBandwidthLatencyTest):

    [P2P (Peer-to-Peer) GPU Bandwidth Latency Test]
    Device: 0, NVIDIA A100-SXM-80GB, pciBusID: e, pciDeviceID: 0, pciDomainID:0
    Device=0 CAN Access Peer Device=1
    Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix (GB/s)
       D\\D     0      1      2
         0 912.68   9.90   9.90
         1   9.90 922.37   9.90
    Bidirectional P2P=Enabled Bandwidth Matrix (GB/s)
    P2P=Enabled Latency (P2P Writes) Matrix (us)
       GPU     0      1
         0   2.59   2.31
       CPU     0      1
         0   2.71   1.91

One `p2p_matrix` event per matrix (quoting its title): what it measures (`bandwidth` in GB/s or `latency` in
us, `unidirectional`/`bidirectional`, P2P enabled or not, writes or reads, GPU or CPU side for latency), the
device indices of its columns, its rows (`values[i][j]`: from device i to device j) and each row's quote. The
devices the header lists and the pairs that cannot reach each other go in the event's fields too (a header with
no matrix after it: one `p2p_devices` event).
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines

KIND = "p2p_bandwidth"
QUIET_WHEN_EMPTY = True

_BANNER = "[P2P (Peer-to-Peer) GPU Bandwidth Latency Test]"
_DEVICE = lazy(
    r"^Device: (\d{1,4}), (.{1,200}?), pciBusID: ([0-9a-fA-F]{1,8}), pciDeviceID: ([0-9a-fA-F]{1,8}), "
    r"pciDomainID:\s?([0-9a-fA-F]{1,8})\s*$"
)
_PEER = lazy(r"^Device=(\d{1,4}) (CAN|CANNOT) Access Peer Device=(\d{1,4})\s*$")
_BW_TITLE = lazy(
    r"^(Unidirectional|Bidirectional) P2P=(Enabled|Disabled) Bandwidth (?:\((P2P Writes|P2P Reads)\) )?"
    r"Matrix \(GB/s\)\s*$"
)
_LAT_TITLE = lazy(r"^P2P=(Enabled|Disabled) Latency (?:\((P2P Writes|P2P Reads)\) )?Matrix \(us\)\s*$")
_CONN_TITLE = lazy(r"^P2P Connectivity Matrix\s*$")
_COLUMNS = lazy(r"^\s{0,12}(D\\{1,2}D|GPU|CPU)((?:\s+\d{1,4}){1,64})\s*$")
_ROW = lazy(r"^\s{0,12}(\d{1,4})((?:\s+(?:\d{1,9}(?:\.\d{1,6})?|nan|inf|-?nan)){1,64})\s*$", re.I)


def sniff(head: bytes) -> int:
    text = head[:16384].decode("utf-8", errors="replace")
    if _BANNER in text:
        return 90
    n = sum(1 for ln in text.splitlines()[:400] if claims(ln) >= 8)
    return min(40 + 15 * n, 85) if n else 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (
    _BANNER,
    "P2P=",
    "Device=",
    "pciBusID:",
    "P2P Connectivity Matrix",
    "***NOTE: In case a device doesn't have P2P access",
)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is p2pBandwidthLatencyTest's own (see probes/reader.py)."""
    s = line.strip()
    if s == _BANNER:
        return 10
    if s.startswith(("Unidirectional P2P=", "Bidirectional P2P=")) and _BW_TITLE.match(s):
        return 10
    if s.startswith("P2P=") and _LAT_TITLE.match(s):
        return 10
    if s.startswith("Device=") and _PEER.match(s):
        return 9
    if s.startswith("Device: ") and "pciBusID:" in s and _DEVICE.match(s):
        return 9
    if _CONN_TITLE.match(s):
        return 8
    if s.startswith("***NOTE: In case a device doesn't have P2P access"):
        return 8
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


def _num(tok: str) -> float | None:
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if v == v and v not in (float("inf"), float("-inf")) else None


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    devices: dict[int, dict[str, str]] = {}
    first_device: Quote | None = None
    no_peer: list[tuple[int, int]] = []
    cur: LogEvent | None = None  # the matrix being read

    def done() -> None:
        nonlocal cur
        if cur is not None and cur.fields["rows"]:
            cur.fields["devices"] = dict(devices)
            cur.fields["no_peer"] = list(no_peer)
            ev.events.append(cur)
        cur = None

    for no, raw in numbered:
        line = raw.rstrip().replace("\t", " ")
        s = line.strip()
        if not s:
            continue
        m = _DEVICE.match(s) if s.startswith("Device: ") else None
        if m:
            devices[int(m.group(1))] = {"name": m.group(2).strip(), "pci_bus_id": m.group(3)}
            first_device = first_device or Quote(src.name, no, raw.strip())
            continue
        m = _PEER.match(s) if s.startswith("Device=") else None
        if m:
            if m.group(2) == "CANNOT":
                no_peer.append((int(m.group(1)), int(m.group(3))))
            continue
        bw = _BW_TITLE.match(s)
        lat = _LAT_TITLE.match(s) if bw is None else None
        if bw or lat or _CONN_TITLE.match(s):
            done()
            if bw or lat:
                first_device = None  # the matrices carry the devices
                q = Quote(src.name, no, raw.strip())
                fields: dict = {
                    "measure": "bandwidth" if bw else "latency",
                    "unit": "GB/s" if bw else "us",
                    "direction": bw.group(1).lower() if bw else None,
                    "p2p": (bw.group(2) if bw else lat.group(1)).lower() == "enabled",
                    "method": ((bw.group(3) if bw else lat.group(2)) or "").replace("P2P ", "").lower()
                    or None,
                    "side": "GPU",
                    "columns": [],
                    "rows": {},
                    "row_quotes": {},
                    "header_quote": None,
                }
                cur = LogEvent("p2p_matrix", q, host=src.host, rank=src.rank, pid=src.pid, fields=fields)
            continue
        if cur is None:
            continue
        m = _COLUMNS.match(line)
        if m:
            cols = [int(c) for c in m.group(2).split()]
            if m.group(1) == "CPU" and cur.fields["rows"]:
                # The latency matrix's CPU half: a matrix of its own, under the same title.
                title = cur.quote
                fields = {k: v for k, v in cur.fields.items()}
                done()
                fields.update(
                    side="CPU",
                    rows={},
                    row_quotes={},
                    columns=cols,
                    header_quote=Quote(src.name, no, raw.strip()),
                )
                cur = LogEvent("p2p_matrix", title, host=src.host, rank=src.rank, pid=src.pid, fields=fields)
            else:
                cur.fields["columns"] = cols
                cur.fields["header_quote"] = Quote(src.name, no, raw.strip())
            continue
        m = _ROW.match(line)
        if m and cur.fields["columns"]:
            vals = [_num(t) for t in m.group(2).split()]
            if len(vals) == len(cur.fields["columns"]):
                i = int(m.group(1))
                cur.fields["rows"][i] = vals
                cur.fields["row_quotes"][i] = Quote(src.name, no, raw.strip())
                continue
        if not _ROW.match(line):
            done()  # anything else ends the matrix
    done()
    if first_device is not None:  # the header alone: which devices, and which pairs cannot reach each other
        ev.events.append(LogEvent("p2p_devices", first_device, host=src.host, rank=src.rank, pid=src.pid,
                                  fields={"devices": dict(devices), "no_peer": list(no_peer)}))  # fmt: skip
