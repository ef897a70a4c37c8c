"""InfiniBand port state: `ibstat` and `ibstatus` (infiniband-diags / rdma-core).

ibstat:

    CA 'mlx5_0'
            CA type: MT4129
            ...
            Port 1:
                    State: Active
                    Physical state: LinkUp
                    Rate: 400
                    Base lid: 12
                    ...
                    Link layer: InfiniBand

ibstatus:

    Infiniband device 'mlx5_0' port 1 status:
            default gid:     fe80:0000:0000:0000:a088:c203:0030:9a0c
            base lid:        0xc
            state:           4: ACTIVE
            phys state:      5: LinkUp
            rate:            400 Gb/sec (4X NDR)
            link_layer:      InfiniBand

One IbPort per CA and port (host from `src.host`), in ibstat's words either way (state Active,
Down, Initializing, Armed; phys_state LinkUp, Polling, Disabled, ...; rate as the Gb/s number).
The quote is the line that tells the port's trouble: the physical state when the link is not
LinkUp, else the state. `ibpanic:` lines (a CA that could not be read) become gaps.
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, IbPort, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines

KIND = "ibstat"

_CA = lazy(r"^CA '([^']+)'\s*$")
_PORT = lazy(r"^\s+Port (\d{1,9}):\s*$")  # {1,9}: int() of 5000 digits raises
_FIELD = lazy(r"^\s+(State|Physical state|Rate|Link layer):\s*(.*?)\s*$")
_IBSTATUS = lazy(r"^Infiniband device '([^']+)' port (\d{1,9}) status:\s*$")
_IBSTATUS_FIELD = lazy(r"^\s+(state|phys state|rate|link_layer):\s*(.*?)\s*$")
_PANIC = lazy(r"^ibpanic: .*")

# ibstatus prints the enum name; ibstat's words are what the rest of hangdx compares against
_STATES = {
    "DOWN": "Down",
    "INIT": "Initializing",
    "ARMED": "Armed",
    "ACTIVE": "Active",
    "ACTIVE_DEFER": "Active",
}


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    if re.search(r"^Infiniband device '[^']+' port \d+ status:", text, re.M):
        return 95
    if re.search(r"^CA '[^']+'\s*$", text, re.M):
        if re.search(r"^\s+Port \d+:\s*$", text, re.M) and re.search(r"^\s+State: ", text, re.M):
            return 95
        return 60
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    ca: str | None = None
    port: IbPort | None = None
    quotes: dict[str, Quote] = {}

    def close() -> None:
        nonlocal port
        if port is not None:
            trouble = port.phys_state not in (None, "LinkUp") and "phys" in quotes
            port.quote = quotes.get("phys" if trouble else "state") or quotes.get("port")
            ev.ib_ports.append(port)
        port = None
        quotes.clear()

    for no, raw in numbered:
        q = Quote(src.name, no, raw)
        if m := _CA.match(raw):
            close()
            ca = m.group(1)
        elif (m := _IBSTATUS.match(raw)) is not None:
            close()
            ca = None
            port = IbPort(host=src.host, ca=m.group(1), port=int(m.group(2)))
            quotes["port"] = q
        elif (m := _PORT.match(raw)) is not None and ca is not None:
            close()
            port = IbPort(host=src.host, ca=ca, port=int(m.group(1)))
            quotes["port"] = q
        elif port is not None and (m := _FIELD.match(raw)) is not None:
            _ibstat_field(port, m.group(1), m.group(2), q, quotes)
        elif port is not None and (m := _IBSTATUS_FIELD.match(raw)) is not None:
            _ibstatus_field(port, m.group(1), m.group(2), q, quotes)
        elif _PANIC.match(raw):
            ev.gap(src.name, raw.strip())
    close()


def _ibstat_field(port: IbPort, key: str, value: str, q: Quote, quotes: dict[str, Quote]) -> None:
    if key == "State":
        port.state = value or None
        quotes["state"] = q
    elif key == "Physical state":
        port.phys_state = value or None
        quotes["phys"] = q
    elif key == "Rate":
        port.rate = value or None
    else:
        port.link_layer = value or None


def _ibstatus_field(port: IbPort, key: str, value: str, q: Quote, quotes: dict[str, Quote]) -> None:
    word = value.split(":", 1)[-1].strip()  # "4: ACTIVE" -> "ACTIVE"
    if key == "state":
        port.state = _STATES.get(word, word.title()) if word else None
        quotes["state"] = q
    elif key == "phys state":
        port.phys_state = word or None
        quotes["phys"] = q
    elif key == "rate":
        m = re.match(r"(\d+(?:\.\d+)?)", value)
        port.rate = m.group(1) if m else (value or None)
    else:
        port.link_layer = value or None


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("Infiniband device '", "CA '")
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is ibstat's or ibstatus's (see probes/reader.py)."""
    if line.startswith("Infiniband device '"):
        return 10
    if line.startswith("CA '") and line.rstrip().endswith("'"):
        return 9
    return 0
