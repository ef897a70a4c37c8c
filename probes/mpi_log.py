"""Open MPI's own messages about the job's processes: which rank died, on which node, of what.

Formats from Open MPI's help texts (orte/ompi `help-errmgr-base.txt`, `help-orterun.txt`), as mpirun prints
them when a process of the job fails:

    mpirun noticed that process rank 7 with PID 31337 on node gpu-node-03 exited on signal 9 (Killed).
    Primary job  terminated normally, but 1 process returned
    a non-zero exit code. Per user-direction, the job has been aborted.
    mpirun detected that one or more processes exited with non-zero status, ...
      Process name: [[35531,1],3]
      Exit code:    1

MPICH's and Intel MPI's launcher (Hydra, pmodels/mpich src/pm/hydra/mpiexec/mpiexec.c) prints its own banner:

    =   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
    =   RANK 3 PID 1234 RUNNING AT c001-001          (older Hydra: `=   PID 1234 RUNNING AT c001-001`)
    =   KILLED BY SIGNAL: 9 (Killed)                 (or `=   EXIT CODE: 9`)

The rank is Open MPI's rank in MPI_COMM_WORLD (Horovod's rank). A node named by a placeholder (`HOSTNAME`,
`<host>`: a poster's redaction) names no host.
"""

from __future__ import annotations

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines as text_lines
from hangdx.probes.text import looks_binary

KIND = "mpi_log"
QUIET_WHEN_EMPTY = True

_NOTICED = lazy(
    r"mpirun noticed that process rank (\d{1,9}) with PID (\d{1,10}) on node (\S{1,253}?) "
    r"exited on signal (\d{1,3})(?: \(([^)]{1,40})\))?"
)
_IMPROPER = lazy(r"process rank (\d{1,9}) with PID (\d{1,10}) on node (\S{1,253}?) exiting improperly")
_PRIMARY = lazy(r"Primary job\s+terminated normally, but (\d{1,9}) process(?:es)? returned")
_DETECTED = "mpirun detected that one or more processes exited with non-zero status"
_PROC_NAME = lazy(r"^\s*Process name:\s*\[\[\d{1,9},\d{1,9}\],(\d{1,9})\]")
_EXIT_CODE = lazy(r"^\s*Exit code:\s*(-?\d{1,4})\s*$")
_HYDRA_BAD = "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
_HYDRA_PID = lazy(r"^\s*=\s+(?:RANK (\d{1,9}) )?PID (\d{1,10}) RUNNING AT (\S{1,253})\s*$")
_HYDRA_CODE = lazy(r"^\s*=\s+EXIT CODE: (-?\d{1,4})\s*$")
_HYDRA_SIGNAL = lazy(r"^\s*=\s+KILLED BY SIGNAL: (\d{1,3})(?: \(([^)]{1,40})\))?\s*$")
_PLACEHOLDERS = {"hostname", "host", "node", "nodename", "localhost.localdomain", "xxx", "redacted"}
SIGNALS = {
    1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
    11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM",
}  # fmt: skip


def real_host(name: str | None) -> str | None:
    """A node name as printed, or None for a redaction (`HOSTNAME`, `<node>`, `xxx`)."""
    if not name:
        return None
    name = name.rstrip(".,;:")
    if name.isupper() or name.lower() in _PLACEHOLDERS or any(c in name for c in "<>*{}$") or "xxx" in name:
        return None
    return name


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (
    "mpirun noticed that process rank",
    _DETECTED,
    _HYDRA_BAD,
    "RUNNING AT ",
    "Primary job",
    "exiting improperly",
    "Process name:",
)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is Open MPI's (see probes/reader.py)."""
    if "mpirun noticed that process rank" in line or _DETECTED in line or _HYDRA_BAD in line:
        return 9
    if _HYDRA_PID.match(line):
        return 6
    if _PRIMARY.search(line) or _IMPROPER.search(line):
        return 8
    if _PROC_NAME.match(line):
        return 6
    return 0


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head.decode("utf-8", errors="replace")
    if (
        "mpirun noticed that process rank" in text
        or _DETECTED in text
        or _PRIMARY.search(text)
        or _HYDRA_BAD in text
    ):
        return 60
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    if not data or looks_binary(data[:8192]):
        return
    parse_lines(list(enumerate(text_lines(data), 1)), src, ev)


def parse_lines(lines: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """mpirun's reports of failed processes, as events: `mpi_rank_exit` per rank, `mpi_job_aborted` per banner."""

    def exit_of(
        quote: Quote, rank: int | None, host: str | None, pid: int | None = None, **how: object
    ) -> None:
        fields = {"signal": None, "signal_number": None, "signal_name": None, "exit_code": None, **how}
        ev.events.append(LogEvent("mpi_rank_exit", quote, host=host, rank=rank, pid=pid, fields=fields))

    pending_rank: tuple[int, int, str] | None = None  # `Process name: [[j,1],R]` waiting for its exit code
    hydra: dict | None = None  # Hydra's `RANK r PID p RUNNING AT host`, waiting for its exit code or signal
    bad_banner = False

    def hydra_exit(**how: object) -> None:
        nonlocal hydra
        if hydra is not None:
            h, hydra = hydra, None
            exit_of(h["quote"], h["rank"], h["host"], h["pid"], launcher="hydra", **how)
            ev.note_host(h["host"])

    for item in lines:
        no, text = item[0], item[1]
        quote = Quote(src.name, no, text)
        if _HYDRA_BAD in text:
            hydra_exit()
            bad_banner = True
            continue
        m = _HYDRA_PID.match(text) if bad_banner else None
        if m:
            hydra_exit()
            hydra = {"quote": quote, "rank": int(m.group(1)) if m.group(1) else None, "pid": int(m.group(2)),
                     "host": real_host(m.group(3)) or src.host}  # fmt: skip
            continue
        m = _HYDRA_SIGNAL.match(text) if hydra else None
        if m:
            sig = int(m.group(1))
            hydra_exit(signal=SIGNALS.get(sig, f"signal {sig}"), signal_number=sig, signal_name=m.group(2))
            continue
        m = _HYDRA_CODE.match(text) if hydra else None
        if m:
            hydra_exit(exit_code=int(m.group(1)))
            continue
        m = _NOTICED.search(text)
        if m:
            sig = int(m.group(4))
            host = real_host(m.group(3)) or src.host
            exit_of(quote, int(m.group(1)), host, int(m.group(2)) or None, signal=SIGNALS.get(sig, f"signal {sig}"),
                    signal_number=sig, signal_name=m.group(5))  # fmt: skip
            ev.note_host(host)
            continue
        m = _IMPROPER.search(text)
        if m:
            exit_of(
                quote,
                int(m.group(1)),
                real_host(m.group(3)) or src.host,
                int(m.group(2)) or None,
                improper=True,
            )
            continue
        m = _PRIMARY.search(text)
        if m:
            ev.events.append(
                LogEvent("mpi_job_aborted", quote, host=src.host, fields={"failed": int(m.group(1))})
            )
            continue
        m = _PROC_NAME.match(text)
        if m:
            pending_rank = (int(m.group(1)), no, text)
            continue
        m = _EXIT_CODE.match(text)
        if m and pending_rank is not None:
            rank, pno, ptext = pending_rank
            pending_rank = None
            exit_of(Quote(src.name, pno, ptext), rank, src.host, exit_code=int(m.group(1)))
    hydra_exit()
