"""Stand-ins for the tools a simulated node lacks (nvidia-smi, ibstat, perfquery, dmesg, ip link, ncclras).

Each node's tool directory (first on its PATH) holds tiny wrappers (written by sim.py) that call `main(tool, node_dir, argv)`.
They print the recorded real-format text the scenario chose for that node (`<node_dir>/tools.json`),
with two substitutions made at run time, inside the node:

    %PID<n>%   the pid of the node's local rank n, as the node sees it (its PID namespace); read from
               `<node_dir>/ranks.json`, which the node's init writes when it starts the ranks. In a table
               cell (placeholder preceded by spaces) the pid is right-aligned to the cell's width.
               nvidia-smi drops the lines of ranks whose process is gone, as the real one does.
    %HOST%     the node's name.

Standard library only, and quick: it runs under `python -S`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

_PLACEHOLDER = re.compile(r"( *)%PID(\d+)%")
_COUNTER = re.compile(r"^(\w+):(\.+)(\d+)$")
_RAW_STAMP = re.compile(r"^\[\s*(\d+)\.(\d{6})\] ")


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def render(text: str, host: str, pids: dict[int, int], live_only: bool = False) -> str:
    """Fill in %HOST% and %PID<n>%; with live_only, drop lines whose rank is not running (or not known)."""
    out = []
    for line in text.splitlines(keepends=True):
        wanted = [int(n) for _, n in _PLACEHOLDER.findall(line)]
        if any(n not in pids for n in wanted):
            if live_only:
                continue
        elif live_only and not all(_alive(pids[n]) for n in wanted):
            continue

        def pid_of(m: re.Match) -> str:
            pid = pids.get(int(m.group(2)))
            if pid is None:
                return m.group(0)
            return str(pid).rjust(len(m.group(0))) if m.group(1) else str(pid)

        out.append(_PLACEHOLDER.sub(pid_of, line).replace("%HOST%", host))
    return "".join(out)


def _emit(result: dict, host: str, pids: dict[int, int], live_only: bool = False) -> int:
    sys.stdout.write(render(result.get("stdout", ""), host, pids, live_only))
    sys.stderr.write(result.get("stderr", ""))
    return int(result.get("returncode", 0))


def nvidia_smi(spec: dict, argv: list[str], host: str, pids: dict[int, int]) -> int:
    """The longest recorded argument prefix that starts the command line wins ("" = no arguments)."""
    args = " ".join(argv)
    keys = [k for k in spec if args.startswith(k)]
    if not keys:
        sys.stdout.write("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n")
        return 2
    return _emit(spec[max(keys, key=len)], host, pids, live_only=True)


def ibstat(text: str, argv: list[str]) -> int:
    """`ibstat`, `ibstat -l` (CA names) and `ibstat <ca> [port]` (that CA's block)."""
    blocks = re.split(r"(?m)^(?=CA ')", text)
    blocks = [b for b in blocks if b.startswith("CA '")]
    names = [b[4 : b.index("'", 4)] for b in blocks]
    if not argv:
        sys.stdout.write(text)
        return 0
    if argv[0] in ("-l", "--list_of_cas"):
        sys.stdout.write("".join(n + "\n" for n in names))
        return 0
    if argv[0] in names:
        sys.stdout.write(blocks[names.index(argv[0])])
        return 0
    sys.stderr.write(
        f"ibpanic: [{os.getpid()}] main: '{argv[0]}' IB device can't be found: No such file or directory\n"
    )
    return 255


def _perfquery_port(argv: list[str]) -> str:
    """The port asked for: "ca:port" from -C/--Ca and -P/--Port (port 1 by default), "" for none."""
    ca, port = None, "1"
    for i, arg in enumerate(argv[:-1]):
        if arg in ("-C", "--Ca"):
            ca = argv[i + 1]
        elif arg in ("-P", "--Port"):
            port = argv[i + 1]
    return f"{ca}:{port}" if ca else ""


def perfquery(samples: dict[str, list[str]], argv: list[str], node_dir: str) -> int:
    """Successive calls for one port print its successive samples; past the last one its counters keep
    rising at their last rate. No -C: the first port (as perfquery queries the first CA). "*": the samples
    of any port not listed. A port with no samples fails as perfquery does when its MADs get no answer."""
    key = _perfquery_port(argv)
    if not key and samples:
        key = next(iter(samples))
    if key not in samples and "*" in samples:
        samples = {key: samples["*"]}
    if key not in samples or not samples[key]:
        # What perfquery prints for a port that takes no MADs (a RoCE port), as in
        # treydock/infiniband_exporter#26.
        ca, _, port = key.partition(":")
        sys.stderr.write(
            f"ibwarn: [{os.getpid()}] mad_rpc_open_port: client_register for mgmt 1 failed\n"
            f"perfquery: iberror: failed: Failed to open '{ca or '(null)'}' port '{port or 0}'\n"
        )
        return 255
    counter_file = os.path.join(node_dir, "perfquery.%s.calls" % re.sub(r"[^A-Za-z0-9_]", "_", key))  # noqa: UP031
    try:
        with open(counter_file) as f:
            calls = int(f.read().strip() or 0)
    except (OSError, ValueError):
        calls = 0
    with open(counter_file + ".tmp", "w") as f:
        f.write(f"{calls + 1}\n")
    os.replace(counter_file + ".tmp", counter_file)
    mine = samples[key]
    if calls < len(mine):
        sys.stdout.write(mine[calls])
    else:
        before = mine[-2] if len(mine) > 1 else mine[-1]
        sys.stdout.write(extrapolate(before, mine[-1], calls - len(mine) + 1))
    return 0


def extrapolate(before: str, last: str, steps: int) -> str:
    """`last` with every decimal counter moved on by `steps` times its rise since `before`."""
    old = {}
    for line in before.splitlines():
        m = _COUNTER.match(line)
        if m:
            old[m.group(1)] = int(m.group(3))
    out = []
    for line in last.splitlines(keepends=True):
        m = _COUNTER.match(line.rstrip("\n"))
        if m and m.group(1) in old:
            value = int(m.group(3))
            value += max(0, value - old[m.group(1)]) * steps
            # perfquery pads the name with dots to a fixed column, whatever the value's length.
            line = f"{m.group(1)}:{m.group(2)}{value}" + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return "".join(out)


def dmesg(text: str, boot: float, argv: list[str]) -> int:
    """Raw `[seconds.micros] ` lines as recorded; `-T`/`--ctime` and `--time-format iso` convert them like dmesg."""
    fmt = "raw"
    if "-T" in argv or "--ctime" in argv or "--time-format=ctime" in argv:
        fmt = "ctime"
    if "--time-format=iso" in argv or (
        "--time-format" in argv and argv[argv.index("--time-format") + 1 :][:1] == ["iso"]
    ):
        fmt = "iso"
    if fmt == "raw" or not _RAW_STAMP.match(text):
        sys.stdout.write(text)
        return 0
    out, width = [], 0
    for line in text.splitlines():
        m = _RAW_STAMP.match(line)
        if not m:
            # A continuation line of a multi-line message: dmesg indents it to the new prefix's width.
            out.append(" " * width + line.lstrip(" ") if width else line)
            continue
        when = boot + int(m.group(1)) + int(m.group(2)) / 1e6
        if fmt == "ctime":
            prefix = "[" + time.strftime("%a %b %e %H:%M:%S %Y", time.localtime(when)) + "] "
        else:
            tz = time.strftime("%z", time.localtime(when))
            micros = int(round((when % 1) * 1e6)) % 1000000
            prefix = (
                time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(when)) + f",{micros:06d}{tz[:3]}:{tz[3:]} "
            )
        width = len(prefix)
        out.append(prefix + line[m.end() :])
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def ip(spec: dict, argv: list[str]) -> int:
    """`ip link` / `ip link show` print the recording; anything else runs the real ip."""
    if argv in (["link"], ["link", "show"], ["l"], ["link", "list"]):
        sys.stdout.write(spec["text"])
        return 0
    os.execv(spec["real"], [spec["real"]] + argv)
    return 127  # not reached


def ncclras(spec: dict, argv: list[str]) -> int:
    """`ncclras [-t N] [-v]` prints the text report, `ncclras ... -f json` the JSON one (NCCL >= 2.28.7)."""
    if "-f" in argv:
        fmt = argv[argv.index("-f") + 1] if argv.index("-f") + 1 < len(argv) else ""
        if fmt not in ("text", "json"):
            sys.stderr.write(f"Invalid format: {fmt} (must be text or json)\n")
            return 1
        sys.stdout.write(spec[fmt])
        return 0
    sys.stdout.write(spec["text"])
    return 0


def main(tool: str, node_dir: str, argv: list[str]) -> int:
    tools = _load(os.path.join(node_dir, "tools.json"))
    host = tools.get("host", "")
    ranks = _load(os.path.join(node_dir, "ranks.json"))
    pids = {int(k): int(v) for k, v in ranks.get("local_pids", {}).items()}
    if tool == "nvidia-smi":
        return nvidia_smi(tools["nvidia-smi"], argv, host, pids)
    if tool == "ibstat":
        return ibstat(tools["ibstat"], argv)
    if tool == "perfquery":
        return perfquery(tools["perfquery"], argv, node_dir)
    if tool == "dmesg":
        spec = tools["dmesg"]
        return dmesg(render(spec["text"], host, pids), spec["boot"], argv)
    if tool == "ip":
        return ip(tools["ip"], argv)
    if tool == "ncclras":
        return ncclras(tools["ncclras"], argv)
    sys.stderr.write(f"{tool}: no stand-in on this node\n")
    return 127
