"""Facts derived from evidence: where each rank is, who is missing, who is the odd one out, is it moving.

Playbooks read these, never the raw artifacts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hangdx.probes import waits
from hangdx.probes.model import (
    CollectiveRecord,
    Evidence,
    Frame,
    LogEvent,
    ProcessState,
    Quote,
    StackDump,
    ThreadStack,
)
from hangdx.probes.rx import lazy

# Which frames mean which wait: the taxonomy in probes/waits.yaml, built from the libraries' sources.
# Its kinds in the words a Location uses (the playbooks and templates say "dataloader" and "io").
LOCATION_KIND = {"data": "dataloader", "storage": "io"}
# A file of the code that loads and iterates a job's data (a path part or file name saying so).
DATA_CODE = lazy(r"(?:^|/)(?:data|datasets?|dataloaders?|data_?loaders?|loaders?|iterators?)(?:/|\.py$)")
IO_SYSCALLS = {
    "read", "write", "pread64", "pwrite64", "readv", "writev", "open", "openat", "fsync",
    "fdatasync", "flock", "statx", "newfstatat", "copy_file_range", "sendfile", "splice", "io_getevents",
}  # fmt: skip
SLEEP_SYSCALLS = {"nanosleep", "clock_nanosleep"}
# Output paths that take a lock (logging's handler lock, tqdm's write lock, rich's console and live locks):
# a thread idle at the top of one waits for that lock; in a forked child, a lock its parent held at fork.
OUTPUT_LOCK_SITES = {
    "logging/__init__.py": {"acquire", "_acquireLock", "_acquireModuleLock", "handle", "flush"},
    "tqdm/std.py": {"acquire", "__enter__", "__new__", "_decr_instances"},
    "rich/live.py": {"run", "start", "stop", "update", "refresh", "process_renderables"},
    "rich/console.py": {"__exit__", "set_live", "clear_live", "push_render_hook", "pop_render_hook",
                        "render_lines", "_write_buffer", "_check_buffer", "export_text", "export_html"},
}  # fmt: skip
OUTPUT_LIBRARIES = ("logging/", "tqdm/", "rich/", "colorama/", "loguru/")


_norm = waits.norm
is_library = waits.is_library


@dataclass
class Location:
    """Where a rank's main thread is, in the field's words."""

    # collective | p2p | init | store | dataloader | io | lock | child | network | sleep | compute | idle | exited
    # | missing | unknown
    kind: str
    op: str | None = None  # allreduce, recv, backward, get, ...
    call_site: str | None = None  # innermost user frame: "sync_gradients (train.py:42)"
    detail: str = ""
    quote: Quote | None = None
    wait: str | None = None  # the waits.yaml row that says so
    frame: Frame | None = None  # the frame it says so on
    peer: int | None = None  # a point-to-point call's peer rank, when the dump's locals name it

    @property
    def op_words(self) -> str | None:
        """The op as an engineer says it: DDP's all-reduce inside loss.backward() is not a call the program wrote."""
        return _OP_WORDS.get(self.op or "", self.op)

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        return (self.kind, self.op, self.call_site)

    def describe(self) -> str:
        what = {
            "collective": _collective_words(self.op),
            "p2p": f"blocked in {self.op}" + (f" with rank {self.peer}" if self.peer is not None else ""),
            "init": "waiting in process-group initialisation",
            "store": "waiting for a key in the c10d store",
            "dataloader": "waiting for its DataLoader",
            "io": "blocked in file I/O",
            "lock": "waiting on a lock or queue in its own code",
            "child": "waiting for a child process or thread",
            "network": "blocked on the network (a socket)",
            "sleep": "sleeping (a polling loop)",
            "compute": "running its own code",
            "idle": "idle in its own code",
            "exited": "gone (process exited)",
            "missing": "missing (no process found)",
        }.get(self.kind, "somewhere unknown")
        if self.call_site:
            what += f" at {self.call_site}"
        if self.detail:
            what += f" ({self.detail})"
        return what


# Ops of the taxonomy's framework rows (probes/waits.yaml), in words.
_OP_WORDS = {
    "backward": "loss.backward() (DDP's gradient all-reduce)",
    "sync": "a CUDA synchronisation",
    "fsdp": "FSDP's parameter all-gather or gradient reduce-scatter",
    "ddp": "DistributedDataParallel's own collectives",
    "deepspeed": "DeepSpeed's gradient reduction",
    "zero": "ZeRO's gradient reduction or parameter all-gather",
    "grad_sync": "Megatron's gradient synchronisation",
}


def _collective_words(op: str | None) -> str:
    if op == "backward":
        return "waiting in loss.backward() (DDP/FSDP reduce gradients from autograd hooks)"
    if op == "sync":
        return "waiting in a CUDA synchronisation (queued collectives must finish)"
    return f"waiting in {op}"


@dataclass
class RankView:
    rank: int
    host: str | None = None
    pid: int | None = None
    stacks: list[StackDump] = field(default_factory=list)  # this rank's main process, in time order
    worker_stacks: list[StackDump] = field(default_factory=list)
    states: list[ProcessState] = field(default_factory=list)
    worker_states: list[ProcessState] = field(default_factory=list)
    locations: list[Location] = field(default_factory=list)  # one per stack sample
    collectives: list[CollectiveRecord] = field(default_factory=list)

    @property
    def location(self) -> Location:
        if self.states and self.states[-1].state in ("exited", "Z", "X"):
            return Location("exited", detail=f"pid {self.pid}")
        return self.locations[-1] if self.locations else Location("unknown")

    @property
    def alive(self) -> bool | None:
        if not self.states:
            return True if self.stacks else None
        return self.states[-1].state not in ("exited", "Z", "X")

    def delta(self, attr: str) -> float | None:
        vals = [getattr(s, attr) for s in self.states if getattr(s, attr) is not None]
        return (vals[-1] - vals[0]) if len(vals) >= 2 else None

    @property
    def sampled_seconds(self) -> float | None:
        ts = [s.sampled_at for s in self.states if s.sampled_at]
        return (ts[-1] - ts[0]) if len(ts) >= 2 else None

    @property
    def moved(self) -> bool:
        """Did the stack change between samples (left its collective, reached another line)?"""
        return len({loc.key for loc in self.locations}) > 1

    def fraction_in(self, kinds: set[str]) -> float:
        if not self.locations:
            return 0.0
        return sum(1 for loc in self.locations if loc.kind in kinds) / len(self.locations)

    @property
    def last_state(self) -> ProcessState | None:
        return self.states[-1] if self.states else None


@dataclass
class Facts:
    ev: Evidence
    job_id: str | None
    world_size: int | None
    ranks: dict[int, RankView]
    missing: list[int]
    exited: list[int]
    crowd: Location | None
    crowd_ranks: list[int]
    odd_ranks: list[int]
    progressing: bool | None
    progress_reason: str = ""
    missing_hosts: dict[int, str] = field(
        default_factory=dict
    )  # missing rank -> the host it was on (inferred)

    @property
    def have_stacks(self) -> bool:
        return any(v.stacks for v in self.ranks.values())

    def ranks_where(self, *kinds: str) -> list[int]:
        return sorted(r for r, v in self.ranks.items() if v.location.kind in kinds)

    def host_of(self, rank: int) -> str | None:
        v = self.ranks.get(rank)
        return (v.host if v and v.host else None) or self.missing_hosts.get(rank)

    def hosts_of(self, ranks: list[int]) -> list[str]:
        return sorted({h for r in ranks if (h := self.host_of(r))})

    def ranks_on(self, hosts: list[str]) -> list[int]:
        """The job's ranks on these hosts, seen or inferred."""
        known = set(self.ranks) | set(self.missing)
        return sorted(r for r in known if self.host_of(r) in hosts)

    @property
    def unprobed_hosts(self) -> set[str]:
        return {p.host for p in self.ev.host_problems}


def user_frame(frames: list[Frame]) -> Frame | None:
    return next((f for f in frames if not is_library(f)), None)


def call_site(frame: Frame | None) -> str | None:
    if frame is None:
        return None
    return f"{frame.function} ({_norm(frame.file)}:{frame.line})" if frame.line else frame.function


def _frame_quote(dump: StackDump, thread: ThreadStack, frame: Frame | None) -> Quote | None:
    """The dump line that shows where the thread is (the frame's own line, verbatim)."""
    if frame is not None and frame.quote is not None:
        return frame.quote
    return thread.quote


def _top_natives(frames: list[Frame]) -> list[Frame]:
    return waits.top_natives(frames)


def _output_lock(frames: list[Frame]) -> Frame | None:
    """The innermost Python frames wait on a lock an output path takes (see OUTPUT_LOCK_SITES)."""
    for i, f in enumerate(frames):
        file = _norm(f.file)
        site = next((fs for p, fs in OUTPUT_LOCK_SITES.items() if file.endswith(p)), ())
        if f.function in site or f.function.rsplit(".", 1)[-1] in site:
            return f
        m = waits.match_python(f)
        if m is not None and m[0].kind == "lock" and _norm(f.file).startswith(("threading.py", "queue.py")):
            continue  # threading's own wait: who called it decides
        if i and file.startswith(OUTPUT_LIBRARIES):
            return frames[i - 1]
        return None
    return None


def _peer(frame: Frame | None) -> int | None:
    """The peer of a point-to-point call, from py-spy --locals (`src: 1`, `dst: 2`; group ranks only with no group)."""
    if frame is None or not frame.locals:
        return None
    no_group = frame.locals.get("group", "None") == "None"
    for key in ("src", "dst", "peer") + (("group_src", "group_dst") if no_group else ()):
        v = frame.locals.get(key, "").strip()
        if v.isdigit():
            return int(v)
    return None


# Where a wait leaves the rank, when only a native frame names it: weak enough for the process state to overrule.
_WEAK_NATIVE = ("lock", "network", "sleep", "io")


def _working_thread(dump: StackDump):
    """The main thread, unless it only serves a runtime (waits.yaml `delegates`): then the thread that waits."""
    main = dump.main_thread()
    if main is None:
        return None
    w = waits.classify(main.frames, main.state not in ("active", "gil"))
    if w is None or w.row is None or not w.row.delegates:
        return main
    for t in dump.threads:
        if t is main:
            continue
        tw = waits.classify(t.frames, t.state not in ("active", "gil"))
        if tw is not None and tw.decisive and tw.row is not None and not tw.row.delegates:
            return t
    return main


def classify(dump: StackDump, state: ProcessState | None) -> Location:
    """Where a process's main thread is: the taxonomy of waits on its frames, then its blocking syscall."""
    thread = _working_thread(dump)
    if thread is None:
        return Location("unknown", detail="no threads in the dump")
    idle = thread.state not in ("active", "gil")
    frames = [f for f in thread.frames if not f.native]
    user = user_frame(frames)
    site = call_site(user)
    wait = waits.classify(thread.frames, idle)

    def loc(kind: str, op: str | None = None, detail: str = "", frame: Frame | None = None) -> Location:
        shown = frame or user or (frames[0] if frames else None)
        return Location(
            kind,
            op,
            site,
            detail,
            _frame_quote(dump, thread, shown),
            wait=wait.row.id if wait is not None and wait.row is not None else None,
            frame=wait.frame if wait is not None else shown,
        )

    if wait is not None and wait.row is not None and wait.row.top_only:
        gil = wait.frame
        how = "waiting for the GIL" + ("" if gil.function == "Waiting for the GIL" else f" in {gil.function}")
        return loc("lock", "the GIL", how, gil)
    kind = LOCATION_KIND.get(wait.kind, wait.kind) if wait is not None else None
    native_only = wait is not None and wait.frame is not None and wait.frame.native
    if not frames and wait is not None and wait.decisive:
        op = {"collective": "a collective", "p2p": "a point-to-point call"}.get(kind, wait.op)
        return loc(kind, op, f"native frame {wait.frame.function}", wait.frame)
    if wait is not None and wait.decisive and kind in ("collective", "p2p", "init", "store"):
        via = f"; native {', '.join(wait.via)}" if wait.via else ""
        detail = f"{wait.frame.function}{via}" if wait.row and wait.row.when_idle else ""
        out = loc(kind, op=wait.op, detail=detail, frame=wait.frame)
        out.peer = _peer(wait.frame) if kind == "p2p" else None
        return out
    held = _output_lock(frames) if idle else None
    if held is not None:
        return loc("lock", op="an output lock", detail=f"{_norm(held.file)} {held.function}", frame=held)
    if wait is not None and wait.decisive and kind == "dataloader" and not native_only:
        return loc("dataloader", detail=wait.frame.function, frame=wait.frame)
    syscall = state.syscall if state else None
    target = state.syscall_target if state else None
    is_socket = bool(target and (target.startswith("socket:") or "(socket)" in target))
    is_anon_pipe = bool(target and target.startswith("pipe:"))
    file_io = syscall in IO_SYSCALLS and not is_socket and not is_anon_pipe
    io_detail = f"{syscall}({target})" if file_io and target else (syscall if file_io else "")
    if wait is not None and wait.decisive and kind == "io":
        how = io_detail or (
            f"in {call_site(wait.frame)}" if not native_only else f"native frame {wait.frame.function}"
        )
        return loc("io", detail=how, frame=wait.frame)
    if state is not None and state.state == "D":
        wchan = f", wchan {state.wchan}" if state.wchan else ""
        return loc(
            "io", detail=f"uninterruptible sleep (D state){wchan}{', ' + io_detail if io_detail else ''}"
        )
    if file_io:
        return loc("io", detail=io_detail or "")
    if wait is not None and wait.decisive and kind == "child":
        # Waiting for a thread of its own (Future.result, Thread.join, a queue it fills): the wait is where that
        # thread is. An engineer follows the chain: a writer thread blocked in open() makes this an I/O stall.
        chained = _awaited_thread(dump, thread, state)
        if chained is not None:
            other, owait, okind = chained
            where = getattr(owait, "call", None) or f"{_norm(owait.frame.file)} {owait.frame.function}"
            what = f"{wait.frame.function} waits for thread {other.name or other.tid}, blocked in {where}"
            return loc(okind, op=owait.op, detail=what, frame=owait.frame)
    if wait is not None and wait.decisive and not native_only and kind in ("lock", "child", "network"):
        what = f"{_norm(wait.frame.file)} {wait.frame.function}"
        if (
            kind == "lock"
            and user is not None
            and (DATA_CODE.search(_norm(user.file)) or user.function.rsplit(".", 1)[-1] == "__next__")
        ):
            # Blocked on a queue or condition inside the code that iterates the data (a framework's own loader:
            # fairseq/data/iterators.py, a project's datasets/loader.py, an iterator's __next__ taking batches a
            # prefetch thread puts in a queue): it waits for its data pipeline's producers.
            return loc("dataloader", detail=f"{user.function} waits on {what}", frame=user)
        return loc(kind, op=wait.op, detail=what, frame=wait.frame)
    if native_only and wait.decisive and kind in ("lock", "child") and idle:
        return loc(kind, detail=f"native frame {wait.frame.function}", frame=wait.frame)
    if syscall in SLEEP_SYSCALLS or (native_only and kind == "sleep"):
        return loc("sleep", detail=syscall or f"native frame {wait.frame.function}")
    if not idle or (state is not None and state.state == "R"):
        return loc("compute")
    if syscall == "futex" and user is not None:
        return loc("lock", detail="futex: a lock, Event or condition")
    if is_anon_pipe or is_socket:
        return loc("idle", detail=f"{syscall} on {target}")
    return loc("idle", detail=syscall or "")


def _awaited_thread(
    dump: StackDump, main, state: ProcessState | None = None
) -> tuple[object, object, str] | None:
    """Another thread of the process blocked on storage, data or the network: (thread, its wait, location kind),
    the first such; None when every other thread is idle elsewhere or computing. A thread whose frames say
    nothing (blocked inside a builtin such as open()) is read by its syscall, when the probe sampled it."""
    blocked = (state.thread_syscalls if state is not None else None) or {}
    for t in dump.threads:
        if t is main or not t.frames:
            continue
        w = waits.classify(t.frames, t.state not in ("active", "gil"))
        k = LOCATION_KIND.get(w.kind, w.kind) if w is not None else None
        if w is not None and w.decisive and w.frame is not None and k in ("io", "dataloader", "network"):
            return t, w, k
        call = blocked.get(str(t.tid)) if t.tid is not None else None
        if call and t.state not in ("active", "gil"):
            frame = user_frame([f for f in t.frames if not f.native]) or t.frames[0]
            return t, _SyscallWait(frame, call), "io"
    return None


@dataclass
class _SyscallWait:
    """A thread's wait read from its blocking syscall, shaped as a taxonomy wait for the caller."""

    frame: Frame
    call: str
    op: str | None = None

    def __post_init__(self) -> None:
        self.op = self.call


def _states_by_pid(ev: Evidence) -> dict[tuple[str | None, int], list[ProcessState]]:
    """Samples per process; keyed by host too, since PIDs repeat across nodes."""
    out: dict[tuple[str | None, int], list[ProcessState]] = {}
    for s in ev.processes:
        out.setdefault((s.host, s.pid), []).append(s)
    for v in out.values():
        v.sort(key=lambda s: s.sampled_at or 0)
    return out


def _nearest_state(states: list[ProcessState], t: float | None) -> ProcessState | None:
    if not states:
        return None
    live = [s for s in states if s.state != "exited"] or states
    if t is None:
        return live[-1]
    return min(live, key=lambda s: abs((s.sampled_at or 0) - t))


def derive(ev: Evidence) -> Facts:
    """All facts a playbook may ask about."""
    _name_ranks_by_ras(ev)
    states = _states_by_pid(ev)
    ranks: dict[int, RankView] = {}

    def view(rank: int) -> RankView:
        if rank not in ranks:
            ranks[rank] = RankView(rank)
        return ranks[rank]

    for (_, pid), ss in states.items():
        s = ss[-1]
        if s.rank is None:
            continue
        v = view(s.rank)
        if s.role == "worker":
            v.worker_states.extend(ss)
        else:
            v.states = ss
            v.pid, v.host = pid, s.host
    for d in sorted(ev.stacks, key=lambda d: d.taken_at or 0):
        rank = d.rank
        if rank is None:
            continue
        v = view(rank)
        if d.role == "worker":
            v.worker_stacks.append(d)
            continue
        v.stacks.append(d)
        v.pid = v.pid or d.pid
        v.host = v.host or d.host
        v.locations.append(classify(d, _nearest_state(states.get((d.host, d.pid or -1), []), d.taken_at)))
    for v in ranks.values():
        _refine_by_native(v)
    for c in ev.collectives:
        if c.rank is not None:
            view(c.rank).collectives.append(c)
            if c.host and not view(c.rank).host:
                view(c.rank).host = c.host

    world = ev.world_size
    if world is None:
        sizes = [s.world_size for s in ev.processes if s.world_size]
        world = max(sizes) if sizes else None
    if world is None:
        nranks = [
            e.fields.get("nranks")
            for e in ev.events_of("nccl_init")
            if isinstance(e.fields.get("nranks"), int)
        ]
        world = max(nranks) if nranks else None
    seen_alive = {r for r, v in ranks.items() if v.stacks or v.states}
    missing = (
        sorted(set(range(world)) - seen_alive) if world and ev.live and (ev.processes or ev.stacks) else []
    )
    exited = sorted(r for r, v in ranks.items() if v.states and v.alive is False)

    missing_hosts = _infer_hosts(ranks, missing, ev)
    located = {r: v.location for r, v in ranks.items() if v.locations and v.alive}
    crowd, crowd_ranks, odd = _crowd(located, _behind_by_ras(ev))
    progressing, reason = _progress(ranks, crowd_ranks)
    return Facts(
        ev=ev,
        job_id=ev.job_id,
        world_size=world,
        ranks=ranks,
        missing=missing,
        exited=exited,
        crowd=crowd,
        crowd_ranks=crowd_ranks,
        odd_ranks=odd,
        progressing=progressing,
        progress_reason=reason,
        missing_hosts=missing_hosts,
    )


def _name_ranks_by_ras(ev: Evidence) -> None:
    """Stacks pasted without a rank (a bare `py-spy dump`) take the rank NCCL RAS gives their process: its report
    names each rank of the job's widest communicator with its host and pid. Only a pid RAS names once, and that
    no stacks from two hosts share."""
    unranked = [d for d in ev.stacks if d.rank is None and d.pid is not None and d.role == "rank"]
    if not unranked:
        return
    named: dict[int, set[int]] = {}
    for groups in _ras_count_groups(ev):
        for g in groups:
            for r, info in (g.get("ranks") or {}).items():
                pid = info.get("pid") if isinstance(info, dict) else None
                if isinstance(pid, int) and isinstance(r, int):
                    named.setdefault(pid, set()).add(r)
    hosts_of_pid: dict[int, set] = {}
    for d in ev.stacks:
        hosts_of_pid.setdefault(d.pid, set()).add(d.host)
    for d in unranked:
        ranks = named.get(d.pid) or set()
        if len(ranks) == 1 and len(hosts_of_pid.get(d.pid, ())) == 1:
            d.rank = next(iter(ranks))


def _refine_by_native(v: RankView) -> None:
    """A sample with native frames says what Python-only samples of the same line could not: a main thread busy on
    one line of its own code may be computing, or spinning in native code that waits (a CUDA synchronisation under
    `.item()` waits for the NCCL kernels queued before it). Earlier samples at the same call site, read as
    computing, were in the wait the native sample names (the collector takes a native sample only when the
    Python samples did not move)."""
    for i, d in enumerate(v.stacks):
        main = d.main_thread()
        loc = v.locations[i] if i < len(v.locations) else None
        if main is None or loc is None or not any(f.native for f in main.frames):
            continue
        if loc.kind in ("compute", "unknown", "idle") or not loc.call_site:
            continue
        for j in range(i):
            other = v.stacks[j].main_thread()
            if (
                other is not None
                and not any(f.native for f in other.frames)
                and v.locations[j].kind in ("compute", "unknown", "idle")
                and v.locations[j].call_site == loc.call_site
            ):
                v.locations[j] = loc


def _infer_hosts(ranks: dict[int, RankView], missing: list[int], ev: Evidence) -> dict[int, str]:
    """Which host a rank nobody saw was on: the block of ranks its neighbours' LOCAL_RANK says a host holds."""
    if not missing:
        return {}
    local = {
        r: s.local_rank
        for r, v in ranks.items()
        for s in v.states[-1:]
        if s.local_rank is not None and v.host
    }
    per_host = max([lr + 1 for lr in local.values()] + [0])
    out: dict[int, str] = {}
    if per_host:
        for r, lr in local.items():
            base = r - lr
            for m in missing:
                if base <= m < base + per_host:
                    out[m] = ranks[r].host  # type: ignore[assignment]
    left = [m for m in missing if m not in out]
    seen_hosts = {v.host for v in ranks.values() if v.host}
    empty = [h for h in (ev.probed_hosts or ev.hosts) if h not in seen_hosts]
    if left and len(empty) == 1:
        out.update({m: empty[0] for m in left})  # one host without ranks: the rest were there
    elif left and per_host and len(empty) * per_host == len(left):
        # Several empty hosts: blocks of consecutive ranks, in the order the hosts were given.
        for i, m in enumerate(sorted(left)):
            out[m] = empty[i // per_host]
    return out


_WAITING = ("collective", "p2p", "init", "store")


def _behind_by_ras(ev: Evidence) -> set[int]:
    """The ranks NCCL RAS's newest report counts behind the others in the job's widest communicator (fewer
    operations of a collective type launched): the ones the others wait for."""
    behind: set[int] = set()
    for groups in _ras_count_groups(ev):
        if len(groups) >= 2:
            top = max(g["value"] for g in groups)
            behind |= {r for g in groups if g["value"] < top for r in (g.get("ranks") or {})}
    return behind


def _ras_count_groups(ev: Evidence) -> list[list[dict]]:
    """NCCL RAS's newest report, in the job's widest communicator (its ranks are the job's): per collective type,
    the groups of ranks that launched the same count (probes/ncclras.py)."""
    reports = ev.events_of("ncclras_report")
    comms = (reports[-1].fields.get("comms") or []) if reports else []
    widest = max([c.get("size") or 0 for c in comms] + [0])
    return [
        count.get("groups") or []
        for c in comms
        if (c.get("size") or 0) == widest
        for count in (c.get("counts") or {}).values()
    ]


def _crowd(
    located: dict[int, Location], behind: set[int] | frozenset[int] = frozenset()
) -> tuple[Location | None, list[int], list[int]]:
    """The place most ranks are (ties go to a collective), and the ranks that are elsewhere. Between places as
    full as each other, both waits, the ranks that the collective records count behind are not the crowd: the
    others wait for them (two ranks, one in evaluate()'s all-reduce and one in the training step's)."""
    if not located:
        return None, [], []
    counts = Counter(loc.key for loc in located.values())
    at: dict[tuple, set[int]] = {}
    for r, loc in located.items():
        at.setdefault(loc.key, set()).add(r)
    best = max(
        counts.items(),
        key=lambda kv: (
            kv[1],
            kv[0][0] in _WAITING,
            not (at[kv[0]] & behind),
            kv[0][0] == "collective",
        ),
    )[0]
    crowd_ranks = sorted(r for r, loc in located.items() if loc.key == best)
    odd = sorted(r for r in located if r not in crowd_ranks)
    return located[crowd_ranks[0]], crowd_ranks, odd


def _progress(ranks: dict[int, RankView], crowd_ranks: list[int]) -> tuple[bool | None, str]:
    """Is the job still advancing? Data still flowing through every rank, or waiting ranks leaving their collective."""
    alive = {r: v for r, v in ranks.items() if v.alive and len(v.states) >= 2}
    io = {r: v.delta("io_bytes") for r, v in alive.items() if v.delta("io_bytes") is not None}
    flowing = sorted(r for r, d in io.items() if d and d > 0)
    # A collective moves bytes through every rank's sockets; in a hang the waiting ranks move none.
    if (
        io
        and len(flowing) >= max(2, -(-3 * len(io) // 4))
        and all(r in flowing for r in crowd_ranks if r in io)
    ):
        total = sum(io[r] for r in flowing)
        return (
            True,
            f"ranks {_fmt(flowing)} kept moving data between samples ({total} bytes read and written)",
        )
    movers = [r for r, v in ranks.items() if v.alive and len(v.locations) >= 2 and v.moved]
    waiting_movers = [r for r in movers if any(loc.kind in _WAITING for loc in ranks[r].locations)]
    if len(waiting_movers) >= max(2, len(ranks) // 2):
        return True, f"ranks {_fmt(waiting_movers)} left their collective between samples"
    sampled = [v for v in ranks.values() if len(v.locations) >= 2]
    if not sampled and not io:
        return None, "one sample per rank: cannot tell a hang from a slow job"
    n = max([len(v.locations) for v in sampled] + [len(v.states) for v in alive.values()] + [0])
    still = " and no data moved through the waiting ranks" if io else ""
    return False, f"no waiting rank left its place across {n} samples{still}"


def _fmt(ranks: list[int]) -> str:
    from hangdx.playbooks.wording import number_set

    return number_set(ranks)


def watchdog_abort(ev: Evidence, crash: LogEvent) -> bool:
    """A SIGABRT that ProcessGroupNCCL's watchdog raised itself: after a collective timed out or NCCL reported an
    error, it says "To avoid data inconsistency, we are taking the entire process down" and rethrows, and the
    uncaught c10::DistBackendError ends in std::terminate (ProcessGroupNCCL.cpp, Watchdog::run). That abort is the
    consequence of what the watchdog caught, which its own lines name; it is no cause of its own."""
    if crash.fields.get("signal") != "SIGABRT":
        return False
    src = crash.quote.source if crash.quote else None
    for e in ev.events_of("nccl_teardown", "process_abort"):
        same = (crash.rank is not None and e.rank == crash.rank) or (
            e.quote is not None and e.quote.source == src
        )
        text = e.quote.text if e.quote else ""
        if same and ("taking the entire process down" in text or "DistBackendError" in text):
            return True
    return False


def row_vote(e: LogEvent, category: str | None, structure: bool = False) -> str | None:
    """How an event counts for `category` (None: for whatever category its row names) in a playbook its kind
    triggers: as the catalogue row that read its line says (`decisive` or `suggestive`; None for a `context` row or
    a row of another category: the row's strength is what the emitter's source says the message means), else, when
    no row read the line, or only a context row of another kind did, as its region parser read it (`parser`: the
    playbook's own reading of the kind).

    `structure`: the kind's parser reads several lines as one event (mpirun's `Process name:` and `Exit code:`, torch
    elastic's failure table), so a row that read one of them does not speak for the event; only a line the
    catalogue alone read is weighed by its row."""
    strength = e.fields.get("signal_strength")
    if strength is None or (structure and not e.fields.get("signal_only")):
        return "parser"
    if strength == "context" and e.fields.get("signal_event") not in (None, e.kind):
        # A context row that read the line as another kind (a generic one: any NCCL WARN, a log prefix) says
        # nothing of the message the parser recognised: the parser's reading stands. A context row of the
        # parser's own kind (Xid 45's row for an Xid) is the specific reading, and does not vote.
        return "parser"
    if strength == "context" or (category is not None and e.fields.get("signal_category") != category):
        return None
    return str(strength)


def votes(events: list[LogEvent], category: str | None, structure: bool = False) -> list[LogEvent]:
    """The events that count for `category` (see `row_vote`)."""
    return [e for e in events if row_vote(e, category, structure) is not None]
