"""Network interfaces: `ip link`, `ip -d link show`, `ip addr` and `ip -o link` (iproute2).

    2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP mode DEFAULT group default qlen 1000
        link/ether 02:fc:00:00:00:01 brd ff:ff:ff:ff:ff:ff
    7: ib0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 4092 qdisc mq state UP group default qlen 256
        link/infiniband 00:00:10:29:fe:80:00:00:... brd 00:ff:ff:ff:ff:12:40:1b:ff:ff:...

One NetLink per interface header line: ifname (without the `@peer` suffix), mtu, and state as
iproute2 prints it (UP, DOWN, UNKNOWN, LOWERLAYERDOWN, DORMANT); when a line has no `state`
word, DOWN if the flags say NO-CARRIER or lack UP. The detail lines (`link/...`, `inet ...`,
`ip -d` attributes) are skipped.
"""

from __future__ import annotations

from hangdx.probes.model import Evidence, NetLink, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines

KIND = "ip_link"

# mtu {1,9} digits: int() of a 5000-digit number raises
_HEADER = lazy(r"^\s*\d+:\s+([^:\s]+):\s+<([^>]*)>\s+mtu\s+(\d{1,9})\b(.*)$")
_STATE = lazy(r"\bstate\s+(\S+)")
_DETAIL = lazy(r"^\s+(?:link/\w+|inet6?\s|valid_lft\s|altname\s)")


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    rows = [ln for ln in head[:32768].decode("utf-8", errors="replace").splitlines() if ln.strip()]
    headers = sum(1 for ln in rows if _HEADER.match(ln))
    if headers == 0:
        return 0
    details = sum(1 for ln in rows if _DETAIL.match(ln))
    # ip output is header lines and their indented details, nothing else
    if (headers + details) / len(rows) >= 0.6:
        return 90 if details else 70
    return 30


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    for no, raw in numbered:
        m = _HEADER.match(raw)
        if not m:
            continue
        name, flags, mtu, rest = m.group(1), m.group(2).split(","), int(m.group(3)), m.group(4)
        st = _STATE.search(rest)
        if st:
            state = st.group(1)
        else:
            state = "DOWN" if "NO-CARRIER" in flags or "UP" not in flags else "UP"
        ifname = name.split("@", 1)[0]
        ev.links.append(
            NetLink(host=src.host, ifname=ifname, mtu=mtu, state=state, quote=Quote(src.name, no, raw))
        )


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (": <",)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is `ip link` / `ip addr` output (see probes/reader.py)."""
    return 8 if ": <" in line and _HEADER.match(line) else 0
