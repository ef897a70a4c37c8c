"""Facts derived from evidence: where each rank is, who is missing, who is the odd one out, is it moving.

Playbooks read these, never the raw artifacts.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from hangdx.probes.model import CollectiveRecord, Evidence, Frame, ProcessState, Quote, StackDump, ThreadStack

COLLECTIVES = {
    "all_reduce": "allreduce",
    "all_reduce_coalesced": "allreduce",
    "all_gather": "allgather",
    "all_gather_into_tensor": "allgather",
    "_all_gather_base": "allgather",
    "all_gather_object": "allgather",
    "all_gather_coalesced": "allgather",
    "reduce_scatter": "reducescatter",
    "reduce_scatter_tensor": "reducescatter",
    "_reduce_scatter_base": "reducescatter",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "all_to_all": "alltoall",
    "all_to_all_single": "alltoall",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",
    "scatter_object_list": "scatter",
    "reduce": "reduce",
}
P2P = {
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
    "batch_isend_irecv": "batch_p2p",
    "send_object_list": "send",
    "recv_object_list": "recv",
    # batch_isend_irecv's context manager: a rank still inside it waits on the peers of its batched send/recv.
    "_coalescing_manager": "batch_p2p",
}
INIT = {
    "init_process_group",
    "_new_process_group_helper",
    "_store_based_barrier",
    "new_group",
    "_create_c10d_store",
    "_env_rendezvous_handler",
    "_tcp_rendezvous_handler",
    "rendezvous",
    "init_device_mesh",
}
# Frames of these files are library code: the user's call site is the first frame outside them.
LIBRARY_PREFIXES = (
    "torch/",
    "threading.py",
    "queue.py",
    "multiprocessing/",
    "concurrent/",
    "selectors.py",
    "socket.py",
    "subprocess.py",
    "<frozen",
    "importlib/",
    "asyncio/",
    "logging/",
    "contextlib.py",
    "functools.py",
    "tempfile.py",
    "shutil.py",
    "pickle.py",
)
LOCK_FRAMES = {
    ("threading.py", "acquire"),
    ("threading.py", "wait"),
    ("threading.py", "join"),
    ("threading.py", "_wait_for_tstate_lock"),
    ("queue.py", "get"),
    ("queue.py", "put"),
    ("queue.py", "join"),
}
# A file of the code that loads and iterates a job's data (a path part or file name saying so).
DATA_CODE = re.compile(
    r"(?:^|/)(?:data|datasets?|dataloaders?|data_?loaders?|loaders?|iterators?)(?:/|\.py$)"
)
IO_SYSCALLS = {
    "read", "write", "pread64", "pwrite64", "readv", "writev", "open", "openat", "fsync",
    "fdatasync", "flock", "statx", "newfstatat", "copy_file_range", "sendfile", "splice", "io_getevents",
}  # fmt: skip
SLEEP_SYSCALLS = {"nanosleep", "clock_nanosleep"}
# Storage I/O in Python: checkpoint and file-system libraries (a path prefix of the frame's file).
STORAGE_IO = (
    "torch/serialization.py", "shutil.py", "pyarrow/fs.py", "pyarrow/_fs", "fsspec/", "gcsfs/", "s3fs/",
    "adlfs/", "boto3/", "botocore/", "s3transfer/", "google/cloud/storage/", "azure/storage/blob/",
    "safetensors/", "torch/distributed/checkpoint/filesystem.py", "torch/distributed/checkpoint/_fsspec",
    "torch/distributed/checkpoint/storage.py", "h5py/", "zarr/", "tensorstore/",
)  # fmt: skip
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
# Native I/O frames that only files make (a read or write may be a socket's or a pipe's).
FILE_ONLY_NATIVE = ("fsync", "fdatasync", "sync_file_range", "msync", "nfs_", "rpc_wait", "pread64",
                    "pwrite64")  # fmt: skip
# Native frames that take the interpreter lock (py-bt prints `Waiting for the GIL` for them).
GIL_WAITS = ("take_gil", "PyEval_RestoreThread", "PyGILState_Ensure", "PyEval_AcquireThread",
             "PyEval_AcquireLock", "Waiting for the GIL")  # fmt: skip


def _norm(path: str) -> str:
    """`/usr/lib/python3.11/site-packages/torch/x.py` -> `torch/x.py`; `/usr/lib/python3.11/queue.py` -> `queue.py`."""
    p = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in p:
            return p.split(marker, 1)[1]
    if "/lib/python3" in p:
        rest = p.split("/lib/python3", 1)[1]
        return rest.split("/", 1)[1] if "/" in rest else rest
    return p


def is_library(frame: Frame) -> bool:
    f = _norm(frame.file)
    return frame.native or f.startswith(LIBRARY_PREFIXES)


@dataclass
class Location:
    """Where a rank's main thread is, in the field's words."""

    kind: str  # collective | p2p | init | dataloader | io | lock | sleep | compute | idle | exited | missing | unknown
    op: str | None = None  # allreduce, recv, ...
    call_site: str | None = None  # innermost user frame: "sync_gradients (train.py:42)"
    detail: str = ""
    quote: Quote | None = None

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        return (self.kind, self.op, self.call_site)

    def describe(self) -> str:
        what = {
            "collective": f"waiting in {self.op}",
            "p2p": f"blocked in {self.op}",
            "init": "waiting in process-group initialisation",
            "dataloader": "waiting for its DataLoader",
            "io": "blocked in file I/O",
            "lock": "waiting on a lock or queue in its own code",
            "sleep": "sleeping",
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


# Native frames (gdb, pystack, py-spy --native) that say where a thread waits when no Python frame does.
NATIVE_WAITS = (
    (("endCoalescing", "batch_isend_irecv", "ProcessGroupNCCL::send", "ProcessGroupNCCL::recv", "ncclSend",
      "ncclRecv", "pointToPoint"), "p2p"),
    (("ProcessGroupNCCL", "WorkNCCL", "ncclKernel", "ncclAllReduce", "ncclGroupEnd", "cudaStreamSynchronize",
      "cudaDeviceSynchronize", "cudaEventSynchronize", "ProcessGroupGloo", "gloo::", "c10d::Reducer"),
     "collective"),
    (("TCPStore", "c10d::Store", "rendezvous", "ncclCommInitRank", "bootstrap"), "init"),
    (("pthread_cond_wait", "pthread_cond_timedwait", "pthread_mutex_lock", "__lll_lock_wait", "sem_wait",
      "do_futex_wait", "futex_wait", "__futex_abstimed_wait", "PyThread_acquire_lock", "take_gil"), "lock"),
    (("nfs_", "rpc_wait", "__libc_read", "__libc_write", "__GI___libc_read", "fsync", "pread64", "pwrite64"),
     "io"),
)  # fmt: skip


def classify_native(frames: list[Frame]) -> tuple[str, Frame] | None:
    """The innermost native frame that names a wait, and what kind of wait (outermost meaning wins ties)."""
    found: tuple[str, Frame] | None = None
    for f in frames:  # innermost first: a lock inside a collective's wait is that collective
        for words, kind in NATIVE_WAITS:
            if any(w in f.function for w in words):
                if (
                    found is None
                    or (found[0] == "lock" and kind in ("collective", "init", "p2p"))
                    or (found[0] == "collective" and kind == "p2p")  # a p2p call's NCCL group is the p2p's
                ):
                    found = (kind, f)
                break
    return found


def _top_natives(frames: list[Frame]) -> list[Frame]:
    """The native frames above the innermost Python frame: the C call that Python frame is in."""
    out = []
    for f in frames:
        if not f.native:
            break
        out.append(f)
    return out


def _gil_wait(frames: list[Frame]) -> Frame | None:
    """A thread whose innermost frames take the GIL waits for the thread that holds it."""
    return next((f for f in _top_natives(frames) if any(w in f.function for w in GIL_WAITS)), None)


def _output_lock(frames: list[Frame]) -> Frame | None:
    """The innermost Python frames wait on a lock an output path takes (see OUTPUT_LOCK_SITES)."""
    for i, f in enumerate(frames):
        file = _norm(f.file)
        if f.function in next((fs for p, fs in OUTPUT_LOCK_SITES.items() if file.endswith(p)), ()):
            return f
        if (file, f.function) in LOCK_FRAMES:
            continue  # threading's own wait: who called it decides
        if i and file.startswith(OUTPUT_LIBRARIES):
            return frames[i - 1]
        return None
    return None


def classify(dump: StackDump, state: ProcessState | None) -> Location:
    """Where a process's main thread is, from its stack and, when known, its blocking syscall."""
    thread = dump.main_thread()
    if thread is None:
        return Location("unknown", detail="no threads in the dump")
    gil = _gil_wait(thread.frames)
    if gil is not None:
        site = call_site(user_frame([f for f in thread.frames if not f.native]))
        how = "waiting for the GIL" + ("" if gil.function == "Waiting for the GIL" else f" in {gil.function}")
        return Location("lock", "the GIL", site, how, gil.quote or thread.quote)
    frames = [f for f in thread.frames if not f.native]
    if not frames and thread.frames:
        native = classify_native(thread.frames)
        if native is not None:
            kind, f = native
            q = f.quote or thread.quote
            op = {"collective": "a collective", "p2p": "a point-to-point call"}.get(kind)
            return Location(kind, op, None, f"native frame {f.function}", q)
    user = user_frame(frames)
    site = call_site(user)

    def loc(kind: str, op: str | None = None, detail: str = "", frame: Frame | None = None) -> Location:
        return Location(
            kind,
            op,
            site,
            detail,
            _frame_quote(dump, thread, frame or user or (frames[0] if frames else None)),
        )

    for f in frames:
        file = _norm(f.file)
        if f.function in INIT and (
            file.startswith("torch/distributed/") or f.function == "init_process_group"
        ):
            return loc("init", op=f.function, frame=f)
    for f in frames:
        file = _norm(f.file)
        if file.startswith("torch/distributed/") and f.function in P2P:
            return loc("p2p", op=P2P[f.function], frame=f)
        if file.startswith("torch/distributed/") and f.function in COLLECTIVES:
            return loc("collective", op=COLLECTIVES[f.function], frame=f)
        if file.startswith("torch/nn/parallel/distributed.py"):
            return loc("collective", op="ddp", detail=f"DistributedDataParallel.{f.function}", frame=f)
    held = _output_lock(frames) if thread.state not in ("active", "gil") else None
    if held is not None:
        return loc("lock", op="an output lock", detail=f"{_norm(held.file)} {held.function}", frame=held)
    for f in frames:
        if _norm(f.file).startswith("torch/utils/data/"):
            return loc("dataloader", detail=f.function, frame=f)
    syscall = state.syscall if state else None
    target = state.syscall_target if state else None
    is_socket = bool(target and (target.startswith("socket:") or "(socket)" in target))
    is_anon_pipe = bool(target and target.startswith("pipe:"))
    file_io = syscall in IO_SYSCALLS and not is_socket and not is_anon_pipe
    io_detail = f"{syscall}({target})" if file_io and target else (syscall if file_io else "")
    for f in frames:
        if _norm(f.file).startswith(STORAGE_IO):
            return loc("io", detail=io_detail or f"in {f.function}", frame=f)
    top = classify_native(_top_natives(thread.frames))
    if top is not None and top[0] == "io" and any(w in top[1].function for w in FILE_ONLY_NATIVE):
        return loc("io", detail=f"native frame {top[1].function}", frame=top[1])
    if state is not None and state.state == "D":
        wchan = f", wchan {state.wchan}" if state.wchan else ""
        return loc(
            "io", detail=f"uninterruptible sleep (D state){wchan}{', ' + io_detail if io_detail else ''}"
        )
    if file_io:
        return loc("io", detail=io_detail or "")
    waits = next((f for f in frames if (_norm(f.file), f.function) in LOCK_FRAMES), None)
    if waits is not None and user is not None and DATA_CODE.search(_norm(user.file)):
        # Blocked on a queue or condition inside the code that iterates the data (a framework's own loader:
        # fairseq/data/iterators.py, a project's datasets/loader.py): it waits for its data loader's workers.
        return loc(
            "dataloader", detail=f"{user.function} waits on {_norm(waits.file)} {waits.function}", frame=user
        )
    if waits is not None:
        return loc("lock", op=waits.function, detail=f"{_norm(waits.file)} {waits.function}", frame=waits)
    if top is not None and top[0] == "lock" and thread.state not in ("active", "gil"):
        return loc("lock", detail=f"native frame {top[1].function}", frame=top[1])
    if syscall in SLEEP_SYSCALLS:
        return loc("sleep", detail=syscall)
    if thread.state in ("active", "gil") or (state is not None and state.state == "R"):
        return loc("compute")
    if syscall == "futex" and user is not None:
        return loc("lock", detail="futex: a lock, Event or condition")
    if is_anon_pipe or is_socket:
        return loc("idle", detail=f"{syscall} on {target}")
    return loc("idle", detail=syscall or "")


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
    crowd, crowd_ranks, odd = _crowd(located)
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


_WAITING = ("collective", "p2p", "init")


def _crowd(located: dict[int, Location]) -> tuple[Location | None, list[int], list[int]]:
    """The place most ranks are (ties go to a collective), and the ranks that are elsewhere."""
    if not located:
        return None, [], []
    counts = Counter(loc.key for loc in located.values())
    best = max(counts.items(), key=lambda kv: (kv[1], kv[0][0] in _WAITING, kv[0][0] == "collective"))[0]
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
