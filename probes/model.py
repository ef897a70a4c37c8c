"""Evidence: what the probes saw, parsed into typed records.

Every parser (one module per artifact kind) adds records to an `Evidence`.
Every record keeps a `Quote` of the verbatim line it came from, so that a
finding can show the proof with its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Source:
    """Where an artifact came from: a file path or "host/probe", and what it is about."""

    name: str
    host: str | None = None
    rank: int | None = None
    pid: int | None = None


@dataclass(frozen=True)
class Quote:
    """A verbatim line of evidence and where it was read (line is 1-based, 0 when not a file line)."""

    source: str
    line: int
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "line": self.line, "text": self.text}


@dataclass
class Frame:
    """One Python (or native) frame as py-spy prints it."""

    function: str
    file: str
    line: int | None = None
    native: bool = False
    locals: dict[str, str] = field(default_factory=dict)
    quote: Quote | None = None  # the dump line this frame was read from

    def where(self) -> str:
        return f"{self.function} ({self.file}:{self.line})" if self.line else f"{self.function} ({self.file})"


@dataclass
class ThreadStack:
    tid: int | None
    name: str
    state: str  # idle | active | gil | unknown
    frames: list[Frame]  # innermost first, as py-spy prints them
    quote: Quote | None = None


@dataclass
class StackDump:
    """One py-spy dump of one process."""

    pid: int | None
    rank: int | None
    host: str | None
    threads: list[ThreadStack]
    source: str
    taken_at: float | None = None  # seconds since the epoch, when known
    python: str | None = None
    command: str | None = None
    role: str = "rank"  # rank | worker (a DataLoader worker or other child of a rank)

    def main_thread(self) -> ThreadStack | None:
        for t in self.threads:
            if t.name == "MainThread":
                return t
        return self.threads[0] if self.threads else None


@dataclass
class ProcessState:
    """One sample of a job process's kernel-visible state (/proc)."""

    host: str | None
    pid: int
    rank: int | None
    local_rank: int | None = None
    world_size: int | None = None
    job_id: str | None = None
    state: str | None = None  # R S D Z T ... or "exited"
    wchan: str | None = None
    syscall: str | None = None  # name of the blocking syscall, e.g. "read", "futex"
    syscall_target: str | None = None  # what its fd points at, e.g. "/mnt/ckpt/x (fifo)"
    cpu_seconds: float | None = None
    io_bytes: int | None = None  # rchar + wchar: sockets and files
    voluntary_switches: int | None = None
    sampled_at: float | None = None
    command: str | None = None
    role: str = "rank"  # rank | worker
    parent_pid: int | None = None
    threads: int | None = None
    # Other threads blocked in a file syscall: OS thread id (as text) -> "syscall(target)". A thread blocked in the
    # builtin open() leaves no library frame in its stack; its syscall says where it is.
    thread_syscalls: dict[str, str] | None = None
    quote: Quote | None = None  # the line it was read from, when read from a pasted table
    # The kernel modules of its kernel stack's frames (`/proc/PID/stack`, tagged `[nvidia]`, `[nfs]`), innermost first.
    kernel_modules: list[str] | None = None


@dataclass
class CollectiveRecord:
    """One collective (or p2p) operation as one rank saw it."""

    rank: int | None
    op: str  # lower-case: allreduce, broadcast, allgather, barrier, send, recv, ...
    seq: int | None = None  # sequence number (collective_seq_id, SeqNum, opCount)
    pg: str | None = None  # process group / communicator id or name
    state: str = "unknown"  # scheduled | started | completed | timed_out | unknown
    numel_in: int | None = None
    numel_out: int | None = None
    dtype: str | None = None
    sizes: Any = None
    host: str | None = None
    time: float | None = None
    quote: Quote | None = None
    origin: str = ""  # flight_recorder | nccl_log | torch_log
    pid: int | None = (
        None  # the process that logged it, when known (NCCL logs name host:pid, not always a rank)
    )
    device: int | None = None  # its CUDA device (NCCL's cudaDev)


@dataclass
class LogEvent:
    """A line that means something: a watchdog timeout, an Xid, an IB error, a traceback, ..."""

    kind: str
    quote: Quote
    host: str | None = None
    rank: int | None = None
    pid: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class GpuState:
    host: str | None
    index: int | None
    uuid: str | None = None
    bus_id: str | None = None
    name: str | None = None
    util_pct: float | None = None
    mem_used_mib: float | None = None
    mem_total_mib: float | None = None
    power_w: float | None = None
    pids: list[int] = field(default_factory=list)
    quote: Quote | None = None
    # The board's power limit (`92W / 400W`): how far from computing a GPU at 100% draws.
    power_limit_w: float | None = None


@dataclass
class IbPort:
    host: str | None
    ca: str
    port: int
    state: str | None = None  # Active, Down, Init, ...
    phys_state: str | None = None  # LinkUp, Polling, Disabled, ...
    rate: str | None = None
    link_layer: str | None = None
    counters: dict[str, int] = field(default_factory=dict)
    sampled_at: float | None = None
    quote: Quote | None = None


@dataclass
class NetLink:
    host: str | None
    ifname: str
    mtu: int | None = None
    state: str | None = None
    quote: Quote | None = None


@dataclass
class Gap:
    """Something a probe could not see or a file could not be read, and why."""

    source: str
    message: str


@dataclass
class HostProblem:
    """A host that could not be probed, and why (it may be the dead node)."""

    host: str
    kind: str  # unreachable | refused | timeout | dns | host_key_unknown | host_key_changed | auth | hung | garbage | too_large | error
    message: str


@dataclass
class Evidence:
    """Everything known about one job, from live probes or saved files."""

    job_id: str | None = None
    world_size: int | None = None
    stacks: list[StackDump] = field(default_factory=list)
    processes: list[ProcessState] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)
    events: list[LogEvent] = field(default_factory=list)
    gpus: list[GpuState] = field(default_factory=list)
    ib_ports: list[IbPort] = field(default_factory=list)
    links: list[NetLink] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    live: bool = False  # probed a running job (vs files read after the fact)
    other_jobs: list[str] = field(default_factory=list)
    host_problems: list[HostProblem] = field(default_factory=list)
    probed_hosts: list[str] = field(default_factory=list)  # every host a live probe was sent to
    reads: list[str] = field(default_factory=list)  # what the reader read of each text, and what it skipped
    # NCCL's `host:pid:` prefixes the reader met (a text's head and its collective lines): host -> pids, whatever
    # their lines became (a topology dump's lines are no event, and still say the process was there).
    nccl_procs: dict[str, set[int]] = field(default_factory=dict)
    last_lines: dict[str, int] = field(
        default_factory=dict
    )  # each text read: the number of its last non-blank line

    def note_host(self, host: str | None) -> None:
        if host and host not in self.hosts:
            self.hosts.append(host)

    def gap(self, source: str, message: str) -> None:
        self.gaps.append(Gap(source, message))

    def events_of(self, *kinds: str) -> list[LogEvent]:
        return [e for e in self.events if e.kind in kinds]
