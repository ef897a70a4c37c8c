"""The GPU topology matrix of `nvidia-smi topo -m`: how each pair of GPUs on a node reaches the other.

            GPU0    GPU1    CPU Affinity    NUMA Affinity
    GPU0     X      NODE    0-63            0
    GPU1    NODE     X      0-63            0

Each cell between two GPUs is the path nvidia-smi reports: `NV#` (a bonded set of # NVLinks), or a PCIe path
`PIX` (at most one PCIe bridge), `PXB` (several bridges), `PHB` (through a PCIe host bridge, the CPU), `NODE`
(between host bridges of one NUMA node), `SYS` (across the SMP interconnect between NUMA nodes; `SOC` in old
drivers). NIC columns (`mlx5_0`, `NIC0`) and the affinity columns are not GPU pairs. One `gpu_topology` event per
matrix: `gpus` (how many), `paths` (each pair's path, as `i-j:PATH`), `nvlink` (any pair over NVLink).
"""

from __future__ import annotations

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines

KIND = "gpu_topology"

_HEADER = lazy(
    r"^\s{0,40}GPU0(?:\s{1,40}(?:GPU\d{1,3}|NIC\d{1,3}|mlx\d_\d{1,3}|\w{1,24}_\d{1,3}))*\s{1,40}CPU Affinity"
)
_ROW = lazy(r"^\s{0,8}GPU(\d{1,3})\s{1,40}((?:(?:X|NV\d{1,3}|SYS|NODE|PHB|PXB|PIX|SOC|PCI)\s{1,40}){1,64})")
_CELL = lazy(r"X|NV\d{1,3}|SYS|NODE|PHB|PXB|PIX|SOC|PCI")


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace").splitlines()
    if not any(_HEADER.match(ln) for ln in text):
        return 0
    return 80 if sum(1 for ln in text if _ROW.match(ln)) >= 2 else 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py): each header and the GPU rows under it."""
    header: tuple[int, str, list[str]] | None = None
    rows: dict[int, list[str]] = {}

    def flush() -> None:
        if header is None or len(rows) < 2:
            return
        no, text, cols = header
        gpu_cols = [i for i, c in enumerate(cols) if c.startswith("GPU")]
        paths = []
        for a, cells in sorted(rows.items()):
            for i in gpu_cols:
                b = int(cols[i][3:])
                if b > a and i < len(cells) and cells[i] != "X":
                    paths.append(f"{a}-{b}:{cells[i]}")
        if not paths:
            return
        ev.events.append(
            LogEvent(
                KIND,
                Quote(src.name, no, text.strip()),
                host=src.host,
                fields={
                    "gpus": len(rows),
                    "paths": paths[:512],
                    "nvlink": any(p.split(":", 1)[1].startswith("NV") for p in paths),
                },
            )
        )

    for no, raw in numbered:
        if _HEADER.match(raw):
            flush()
            cols = raw.split("CPU Affinity", 1)[0].split()
            header, rows = (no, raw, cols), {}
            continue
        m = _ROW.match(raw)
        if header is not None and m:
            rows[int(m.group(1))] = _CELL.findall(m.group(2))
    flush()


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words.
CLAIM_WORDS = ("GPU",)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is a row or the header of `nvidia-smi topo -m` (see probes/reader.py)."""
    if "GPU" not in line:
        return 0
    return 8 if _HEADER.match(line) or _ROW.match(line) else 0
