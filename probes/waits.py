"""The taxonomy of waits: what a live stack's frames say a thread waits on (rows in waits.yaml).

A thread's frames (innermost first, as py-spy prints them) are read the way an engineer reads them:

1. the library frames the innermost user frame called (the "leaf run") say what that call does: the outermost
   of them that names a wait wins (`Queue.get` over the `Condition.wait` it calls; `Tensor.backward` over
   `_engine_run_backward`);
2. a `context` row anywhere outside it (a DataLoader's `__next__`, `torch.load`) makes everything under it that
   kind of wait, whatever it calls: the program's dataset code under `__next__` is the rank waiting for data;
3. rows marked `when_idle` (loss.backward(), DDP's forward, FSDP, DeepSpeed's engine) are waits only when the
   thread is idle: an active thread there computes;
4. native frames (py-spy --native, pystack, gdb) above the innermost Python frame, or the whole stack when it
   has no Python frame, tell what the Python frames cannot: `c10d::Reducer::finalize_backward` under
   `_engine_run_backward` is DDP's gradient all-reduce; a specific library frame outranks a primitive
   (`pthread_cond_wait`) every wait goes through.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources

from hangdx.probes.model import Frame

KINDS = (
    "collective", "p2p", "init", "store", "data", "storage", "lock", "child", "network", "sleep", "compute",
)  # fmt: skip
# Python frames of these files are library code (the user's call site is the first frame outside them), besides
# every file a row names.
LIBRARY_PREFIXES = (
    "torch/", "threading.py", "queue.py", "multiprocessing/", "concurrent/", "selectors.py", "socket.py",
    "subprocess.py", "<frozen", "importlib/", "asyncio/", "logging/", "contextlib.py", "functools.py",
    "tempfile.py", "shutil.py", "pickle.py", "deepspeed/", "accelerate/", "lightning/", "pytorch_lightning/",
    "lightning_fabric/", "megatron/", "transformers/", "torchmetrics/", "ssl.py", "http/", "urllib/",
    "urllib3/", "requests/", "datasets/", "safetensors/", "fsspec/",
)  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One row of waits.yaml."""

    id: str
    kind: str
    meaning: str
    source: str
    files: tuple[str, ...] = ()
    functions: dict[str, str | None] = field(default_factory=dict)  # name -> op (None: the function's name)
    native: tuple[str, ...] = ()
    op: str | None = None
    scope: str = "leaf"
    when_idle: bool = False
    priority: int = 0
    decisive: bool = True
    top_only: bool = False
    delegates: bool = False  # the thread only serves a runtime: the program's work runs on another thread
    examples: tuple[str, ...] = ()

    def match_file(self, path: str) -> bool:
        return any(_file_matches(path, f) for f in self.files)

    def match_function(self, name: str) -> str | None:
        """The op this row gives the function, "" when it matches without one, None when it does not match."""
        if "*" in self.functions:
            return self.op or _short(name)
        for key in (name, _short(name)):
            if key in self.functions:
                return self.functions[key] or self.op or _short(name)
        return None

    def match_native(self, symbol: str) -> bool:
        return any(p.search(symbol) for p in _native_patterns(self.native))


@dataclass(frozen=True)
class Wait:
    """What a thread waits on, and the frame that says so."""

    kind: str  # one of KINDS
    op: str | None
    row: Row | None
    frame: Frame | None
    via: tuple[str, ...] = ()  # the other rows that agree (a native frame confirming a Python one)
    decisive: bool = True

    @property
    def meaning(self) -> str:
        return self.row.meaning if self.row else ""


def _short(name: str) -> str:
    """`_MultiProcessingDataLoaderIter._try_get_data` -> `_try_get_data` (py-spy 0.4 prints qualified names)."""
    return name.rsplit(".", 1)[-1]


def norm(path: str) -> str:
    """`/usr/lib/python3.11/site-packages/torch/x.py` -> `torch/x.py`; `/usr/lib/python3.11/queue.py` -> `queue.py`."""
    p = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in p:
            return p.split(marker, 1)[1]
    if "/lib/python3" in p:
        rest = p.split("/lib/python3", 1)[1]
        return rest.split("/", 1)[1] if "/" in rest else rest
    return p


def _file_matches(path: str, entry: str) -> bool:
    """A `.py` entry is a suffix of the path (whole path parts); any other is a folder or name prefix."""
    if entry.startswith("<"):
        return path == entry
    p = "/" + path
    if entry.endswith(".py"):
        return p.endswith("/" + entry)
    return ("/" + entry) in p


@functools.cache
def _native_patterns(words: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """A word matches at an identifier boundary; a short plain word (`read`, `poll`) must be the whole name."""
    out = []
    for w in words:
        tail = r"(?![A-Za-z0-9_])" if len(w) <= 7 and re.fullmatch(r"\w+", w) else ""
        out.append(re.compile(r"(?<![A-Za-z0-9_])" + re.escape(w) + tail))
    return tuple(out)


def _as_tuple(v: object) -> tuple[str, ...]:
    if v is None:
        return ()
    return tuple(str(x) for x in v) if isinstance(v, list) else (str(v),)


def _row(d: dict) -> Row:
    funcs = d.get("functions") or {}
    if isinstance(funcs, list):
        funcs = {str(f): None for f in funcs}
    kind = str(d["kind"])
    if kind not in KINDS:
        raise ValueError(f"waits.yaml row {d.get('id')}: unknown kind {kind}")
    return Row(
        id=str(d["id"]),
        kind=kind,
        meaning=str(d.get("meaning", "")),
        source=str(d.get("source", "")),
        files=_as_tuple(d.get("file")),
        functions={str(k): (str(v) if v is not None else None) for k, v in funcs.items()},
        native=_as_tuple(d.get("native")),
        op=str(d["op"]) if d.get("op") is not None else None,
        scope=str(d.get("scope", "leaf")),
        when_idle=bool(d.get("when_idle", False)),
        priority=int(d.get("priority", 0)),
        decisive=bool(d.get("decisive", True)),
        top_only=bool(d.get("top_only", False)),
        delegates=bool(d.get("delegates", False)),
        examples=_as_tuple(d.get("examples")),
    )


@functools.lru_cache(maxsize=1)
def rows() -> tuple[Row, ...]:
    import yaml  # here: a text with no stack never needs the taxonomy

    text = resources.files("hangdx.probes").joinpath("waits.yaml").read_text(encoding="utf-8")
    return tuple(_row(d) for d in yaml.safe_load(text))


@functools.lru_cache(maxsize=1)
def _python_rows() -> tuple[Row, ...]:
    return tuple(r for r in rows() if r.files)


@functools.lru_cache(maxsize=1)
def _native_rows() -> tuple[Row, ...]:
    return tuple(r for r in rows() if r.native)


def is_library(frame: Frame) -> bool:
    return frame.native or _is_library_file(frame.file)


@functools.lru_cache(maxsize=65536)
def _is_library_file(file: str) -> bool:
    """Whether a file is a library's: asked for every frame of every rank, so answered once per file name."""
    f = norm(file)
    return f.startswith(LIBRARY_PREFIXES) or any(r.match_file(f) for r in _python_rows())


def match_python(frame: Frame) -> tuple[Row, str] | None:
    """The row a Python frame matches, and the op it gives."""
    return _match_python(frame.file, frame.function)


@functools.lru_cache(maxsize=65536)
def _match_python(file: str, function: str) -> tuple[Row, str] | None:
    """match_python by the frame's file and function: thousands of ranks share a few distinct frames."""
    f = norm(file)
    for r in _python_rows():
        if r.match_file(f):
            op = r.match_function(function)
            if op is not None:
                return r, op
    return None


def match_native(frame: Frame) -> Row | None:
    """The most specific native row a frame matches."""
    best = None
    for r in _native_rows():
        if r.match_native(frame.function) and (best is None or r.priority > best.priority):
            best = r
    return best


def top_natives(frames: list[Frame]) -> list[Frame]:
    """The native frames above the innermost Python frame: the C call that Python frame is in (all, if none)."""
    out = []
    for f in frames:
        if not f.native:
            break
        out.append(f)
    return out


def classify_native(frames: list[Frame], idle: bool = True) -> Wait | None:
    """The wait the native frames name: the highest-priority row, the outermost frame among equals."""
    best: tuple[Row, Frame] | None = None
    for f in frames:
        r = match_native(f)
        if r is None or (r.when_idle and not idle):
            continue
        if best is None or r.priority >= best[0].priority:
            best = (r, f)
    if best is None:
        return None
    r, f = best
    return Wait(r.kind, r.op, r, f, decisive=r.decisive)


def gil_wait(frames: list[Frame]) -> Frame | None:
    """A thread whose innermost native frames take the GIL waits for the thread that holds it."""
    for f in top_natives(frames):
        r = match_native(f)
        if r is not None and r.top_only:
            return f
    return None


def classify(frames: list[Frame], idle: bool = True) -> Wait | None:
    """What a thread waits on (None: no row says; the caller decides from the thread and process state)."""
    gil = gil_wait(frames)
    if gil is not None:
        r = match_native(gil)
        return Wait(r.kind, r.op, r, gil) if r is not None else None
    python = [f for f in frames if not f.native]
    natives = top_natives(frames) if python else frames
    native = classify_native(natives, idle)
    leaf_run: list[Frame] = []
    for f in python:
        if not is_library(f):
            break
        leaf_run.append(f)
    leaf: Wait | None = None
    for f in leaf_run:  # innermost first: the outermost match of the run wins
        m = match_python(f)
        if m is None:
            continue
        r, op = m
        if r.when_idle and not idle:
            continue
        leaf = Wait(r.kind, op, r, f)
    context: Wait | None = None
    for f in python:
        m = match_python(f)
        if m is not None and m[0].scope == "context" and not (m[0].when_idle and not idle):
            context = Wait(m[0].kind, m[1], m[0], f)  # outermost context wins
    if context is not None and (leaf is None or leaf.kind not in ("collective", "p2p", "init", "store")):
        return context
    if leaf is not None:
        if native is not None and native.decisive and native.kind == leaf.kind and native.row is not None:
            return Wait(leaf.kind, leaf.op, leaf.row, leaf.frame, (native.row.id,))
        if (
            native is not None
            and native.kind == "p2p"
            and native.row.priority > 3
            and leaf.kind == "collective"
        ):
            return (
                native  # c10d's own p2p frames under a collective-looking Python frame: a coalesced p2p batch
            )
        return leaf
    return native
