"""Bundles: the raw artifacts of one diagnosis, as collector documents or as a folder of files.

A bundle folder holds `manifest.json` and one sub-folder per host with the artifacts as the
collector brought them, so that `hangdx analyze DIR` reads exactly what the live run read.
"""

from __future__ import annotations

import collections
import errno
import io
import json
import os
import stat
import time
from pathlib import Path
from typing import BinaryIO

from hangdx.probes import reader
from hangdx.probes.model import Evidence, HostProblem, Source
from hangdx.probes.naming import host_from_path, local_rank_from_path, rank_from_name
from hangdx.probes.registry import parse_artifact
from hangdx.probes.rx import lazy
from hangdx.probes.text import MAX_TEXT_BYTES

MANIFEST = "manifest.json"
# A dump (a pickle, or a JSON object) is read from its start, up to MAX_FILE_BYTES; any other file only its
# last MAX_TEXT_BYTES, all that a text parser keeps (text.decode). Nothing else is ever read into memory.
MAX_FILE_BYTES = 512 * 1024 * 1024
_SAFE = lazy(r"[^A-Za-z0-9._-]+")


def artifact_bytes(artifact: dict) -> bytes:
    data = artifact.get("data") or ""
    if not isinstance(data, str):
        raise ValueError(f"its data is a {type(data).__name__}, not text")
    # Binary artifacts (Flight Recorder pickles) travel as latin-1 text inside the JSON document.
    return data.encode("latin-1", "replace") if artifact.get("kind") == "flight_recorder" else data.encode()


def _file_name(value: object, default: str) -> str:
    """A name from a node, safe as one file name: no "/", no "." or "..", no leading dot (hidden: never read)."""
    return _SAFE.sub("_", str(value or "")).lstrip(".") or default


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def evidence_from_documents(docs: list[dict], job_id: str | None = None) -> Evidence:
    """Parse collector documents (one per host) into Evidence; a part of the wrong shape becomes a gap."""
    ev = Evidence(job_id=job_id, live=True)
    for doc in docs:
        if not isinstance(doc, dict):
            ev.gap("collector", f"a collector document is a {type(doc).__name__}, not an object: skipped")
            continue
        host = doc.get("host") if isinstance(doc.get("host"), str) else None
        if host and host not in ev.probed_hosts:
            ev.probed_hosts.append(host)
        problem = doc.get("problem")
        if isinstance(problem, dict):
            ev.host_problems.append(
                HostProblem(str(host), str(problem.get("kind", "error")), str(problem.get("message", "")))
            )
        else:
            ev.note_host(host)
        for err in _list(doc.get("errors")):
            err = err if isinstance(err, dict) else {"message": err}
            ev.gap(f"{host}/{err.get('source')}", str(err.get("message")))
        for other in _list(doc.get("other_jobs")):
            if isinstance(other, str) and other not in ev.other_jobs:
                ev.other_jobs.append(other)
        arts = doc.get("artifacts")
        if arts is not None and not isinstance(arts, list):
            ev.gap(f"{host}/artifacts", f"the collector's artifacts are a {type(arts).__name__}, not a list")
        for art in _list(arts):
            if not isinstance(art, dict):
                ev.gap(f"{host}/artifacts", f"an artifact is a {type(art).__name__}, not an object: skipped")
                continue
            name = f"{host}/{art.get('name')}"
            src = Source(name, host=host, rank=_opt_int(art.get("rank")), pid=_opt_int(art.get("pid")))
            kind = art.get("kind") if isinstance(art.get("kind"), str) else None
            try:
                data = artifact_bytes(art)
            except ValueError as e:
                ev.gap(name, f"unreadable artifact: {e}")
                continue
            # A rank's own stdout/stderr is read only for what a parser recognises in it.
            parse_artifact(data, src, ev, kind=None if kind == "log" else kind, quiet=kind == "log")
    return ev


class BundleRefused(OSError):
    """Where a bundle would be written is not safe to write: one line saying why."""


def check_destination(root: Path) -> None:
    """Refuse a path through a link another user owns (root could be made to write anywhere), and a bundle
    folder that exists but is not this user's own: a link, a file, someone else's folder, or a folder with
    other things in it. Said early (before probing); the writer checks again on what it opened."""
    try:
        fd = open_folder(root, create=False)
    except FileNotFoundError:
        return
    try:
        _check_own(fd, root)
    finally:
        os.close(fd)


_MAX_HOPS = 40  # links followed in one path (the kernel's own limit)


def open_folder(path: Path, create: bool) -> int:
    """A descriptor of folder `path`, reached one name at a time from / (or the working folder) with
    openat(O_NOFOLLOW | O_DIRECTORY): a link on the way is followed only when root or this user owns it (its
    target walked the same way), never the last name. Nothing is looked up twice, so a folder swapped for a
    link while hangdx walks cannot redirect it. `create`: make the last folder (0700) when missing."""
    me = os.geteuid()
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    names = [str(p) for p in (path.parts[1:] if path.is_absolute() else path.parts)]
    fd = os.open("/" if path.is_absolute() else ".", flags)
    where = Path(path.anchor or ".")
    hops = 0
    try:
        while names:
            name = names.pop(0)
            last = not names
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not (last and create):
                    raise
                os.mkdir(name, 0o700, dir_fd=fd)
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            here = where / name
            if stat.S_ISLNK(st.st_mode):
                if last or st.st_uid not in (0, me):
                    raise BundleRefused(
                        f"{here} is a symbolic link: hangdx writes a bundle only into a real folder"
                    )
                hops += 1
                if hops > _MAX_HOPS:
                    raise BundleRefused(f"{path}: too many symbolic links on the way")
                target = Path(os.readlink(name, dir_fd=fd))
                names[:0] = [str(p) for p in (target.parts[1:] if target.is_absolute() else target.parts)]
                if target.is_absolute():
                    os.close(fd)
                    fd = os.open("/", flags)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise BundleRefused(f"{here} exists and is not a folder")
            nxt = os.open(name, flags, dir_fd=fd)  # O_NOFOLLOW: a link swapped in since the stat is refused
            os.close(fd)
            fd, where = nxt, here
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_own(fd: int, root: Path) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise BundleRefused(f"{root} belongs to another user (uid {st.st_uid}): give a new folder")
    names = set(os.listdir(fd))
    if names and MANIFEST not in names:
        raise BundleRefused(f"{root} is not empty and holds no hangdx bundle: give a new folder")


class _Writer:
    """Writes under one folder this process made (mode 0700) or owns: each file created anew (0600), through
    directory descriptors, never following a link."""

    def __init__(self, root: Path) -> None:
        try:
            self.fd = open_folder(root, create=True)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a link swapped in between the stat and the open
                raise BundleRefused(f"{root}: a folder on the way became a symbolic link") from None
            raise
        try:
            _check_own(self.fd, root)
            os.fchmod(self.fd, 0o700)
        except BaseException:
            os.close(self.fd)
            raise
        self.dirs: dict[str, int] = {}

    def folder(self, name: str) -> int:
        if name not in self.dirs:
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
            self.dirs[name] = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd)
        return self.dirs[name]

    def write(self, name: str, data: bytes, folder: str | None = None) -> None:
        dir_fd = self.folder(folder) if folder else self.fd
        try:
            os.unlink(
                name, dir_fd=dir_fd
            )  # a bundle saved again: the file is made anew, never written through
        except FileNotFoundError:
            pass
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        with open(fd, "wb") as f:
            f.write(data)

    def close(self) -> None:
        for fd in self.dirs.values():
            os.close(fd)
        os.close(self.fd)


def save(docs: list[dict], directory: str | Path, job_id: str | None) -> Path:
    """Write collector documents as a bundle folder: a new folder (or a bundle this user saved before), files
    readable only by this user; never through a symbolic link (BundleRefused says why)."""
    root = Path(directory)
    w = _Writer(root)
    try:
        hosts = []
        for doc in docs:
            if not isinstance(doc, dict):
                continue
            host = _file_name(doc.get("host"), "unknown-host")
            hosts.append(host)
            w.folder(host)
            for art in _list(doc.get("artifacts")):
                if not isinstance(art, dict) or not isinstance(art.get("data") or "", str):
                    continue  # what evidence_from_documents reports as a gap; errors.json keeps the others
                w.write(_file_name(art.get("name"), "artifact"), artifact_bytes(art), host)
            if doc.get("errors"):
                w.write("errors.json", json.dumps(doc["errors"], indent=1).encode(), host)
            if doc.get("problem"):
                w.write("problem.json", json.dumps(doc["problem"], indent=1).encode(), host)
        manifest = {
            "hangdx_bundle": 1,
            "job_id": job_id,
            "hosts": hosts,
            "created": time.time(),
            "other_jobs": sorted(
                {
                    o
                    for d in docs
                    if isinstance(d, dict)
                    for o in _list(d.get("other_jobs"))
                    if isinstance(o, str)
                }
            ),
        }
        w.write(MANIFEST, json.dumps(manifest, indent=1).encode())
    finally:
        w.close()
    return root


def _walk(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]  # a file, or a FIFO or device given by name: _read says why it is not read
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return out


class InputError(Exception):
    """A path the user gave cannot be read (exit status 2)."""


class _Skip(Exception):
    """A file hangdx does not read, and why (the message of its gap)."""


_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _read(f: Path, bundle_root: Path | None = None) -> tuple[bytes, int]:
    """What hangdx reads of one file (see MAX_FILE_BYTES), and its size: only regular files, in a bundle its own."""
    if bundle_root is not None:
        real, root = os.path.realpath(f), os.path.realpath(bundle_root)
        if os.path.commonpath([real, root]) != root:
            raise _Skip(f"a link out of the bundle (to {real}): not read")
    try:
        mode = os.stat(f).st_mode
        if not stat.S_ISREG(mode):  # checked before opening: opening a FIFO with no writer blocks
            raise _Skip(f"not a regular file ({_NOT_REGULAR.get(stat.S_IFMT(mode), 'special')}): not read")
        with open(os.open(f, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if _is_dump(fh.read(64)):
                fh.seek(0)
                return fh.read(MAX_FILE_BYTES), size
            # One byte more than text.decode() keeps, so that it sees the cut and drops the partial line.
            fh.seek(max(0, size - MAX_TEXT_BYTES - 1))
            return fh.read(MAX_TEXT_BYTES + 1), size
    except OSError as e:
        raise _Skip(f"unreadable: {e.strerror or e}") from None


def _is_dump(head: bytes) -> bool:
    """A pickle or a JSON document: read from its start (a text log is read from its end)."""
    return head[:1] == b"\x80" or head.lstrip()[:1] == b"{"


def read_stream(stream: BinaryIO) -> bytes:
    """A stream (`-`: standard input) capped as a file is; an endless one (/dev/zero) stops at MAX_FILE_BYTES."""
    chunks: collections.deque[bytes] = collections.deque()
    kept = total = 0
    dump = None
    while total < MAX_FILE_BYTES:
        chunk = stream.read(min(1 << 20, MAX_FILE_BYTES - total))
        if not chunk:
            break
        dump = _is_dump(chunk) if dump is None else dump
        chunks.append(chunk)
        kept, total = kept + len(chunk), total + len(chunk)
        while not dump and kept - len(chunks[0]) > MAX_TEXT_BYTES:
            kept -= len(chunks.popleft())  # a log: only its tail is kept (see _read)
    data = b"".join(chunks)
    return data if dump else data[-(MAX_TEXT_BYTES + 1) :]


def evidence_from_paths(paths: list[str], stdin: BinaryIO | bytes | None = None) -> Evidence:
    """Parse files, folders and bundles (and `-` for standard input) into Evidence."""
    ev = Evidence()
    for p in paths:
        if p == "-":
            stream = io.BytesIO(stdin) if isinstance(stdin, bytes) or stdin is None else stdin
            reader.read_any(stream, Source("<stdin>"), ev, limit=reader.STDIN_MAX)
            continue
        path = Path(p)
        if not path.exists():
            why = (
                "a broken symbolic link (or a link loop)"
                if path.is_symlink()
                else "no such file or directory"
            )
            raise InputError(f"{p}: {why}")
        if not os.access(path, os.R_OK):
            raise InputError(f"{p}: permission denied")
        base = path if path.is_dir() else path.parent
        bundle_root = path if path.is_dir() and (path / MANIFEST).exists() else None
        if bundle_root is not None:
            _read_manifest(path, ev)
        for f in _walk(path):
            if f.name == MANIFEST:
                continue
            rel = f.relative_to(base).as_posix() if f != path else f.name
            try:
                if f.name in ("errors.json", "problem.json") and path.is_dir():  # a host folder's, as saved
                    read = _read_errors if f.name == "errors.json" else _read_problem
                    read(_read(f, bundle_root)[0], f.parent.name, ev)
                    continue
                fh = _open(f, bundle_root)
            except _Skip as e:
                ev.gap(rel, str(e))
                continue
            with fh:
                src = Source(rel, host=host_from_path(rel), rank=_rank_of_file(rel, f.name, path))
                try:
                    reader.read_any(fh, src, ev)
                except OSError as e:
                    ev.gap(rel, f"unreadable: {e.strerror or e}")
    return ev


def _rank_of_file(rel: str, name: str, root: Path) -> int | None:
    """A file's rank from its name; in a torchrun `--log-dir` tree of one node, its local rank is its rank.

    What the file says (a `[rankN]:` prefix, a process's RANK) wins over this: Source is only the default.
    With the nodes' trees side by side (`node-a/<run>/attempt_0/3/...`) a local rank is no global rank: None.
    """
    rank = rank_from_name(name)
    if rank is not None:
        return rank
    local = local_rank_from_path(rel)
    if local is None or host_from_path(rel):
        return None
    return local


def _open(f: Path, bundle_root: Path | None = None) -> BinaryIO:
    """A regular file opened for reading (in a bundle, only one of its own): never a FIFO, device or link out."""
    if bundle_root is not None:
        real, root = os.path.realpath(f), os.path.realpath(bundle_root)
        if os.path.commonpath([real, root]) != root:
            raise _Skip(f"a link out of the bundle (to {real}): not read")
    try:
        mode = os.stat(f).st_mode
        if not stat.S_ISREG(mode):  # checked before opening: opening a FIFO with no writer blocks
            raise _Skip(f"not a regular file ({_NOT_REGULAR.get(stat.S_IFMT(mode), 'special')}): not read")
        return open(os.open(f, os.O_RDONLY | os.O_NONBLOCK), "rb")
    except OSError as e:
        raise _Skip(f"unreadable: {e.strerror or e}") from None


def _json(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        return None


def _read_manifest(root: Path, ev: Evidence) -> None:
    """The bundle's job, hosts and other jobs; a host the manifest names without its folder is a gap."""
    try:
        m = _json(_read(root / MANIFEST, root)[0])
    except _Skip as e:
        m = e
    if not isinstance(m, dict):
        ev.gap(MANIFEST, f"bundle manifest unreadable{f' ({m})' if isinstance(m, _Skip) else ''}")
        return
    job = m.get("job_id")
    ev.job_id = ev.job_id or (str(job) if isinstance(job, (str, int)) and not isinstance(job, bool) else None)
    ev.live = True  # a saved bundle is a live probe, read later
    ev.other_jobs.extend(str(o) for o in _list(m.get("other_jobs")) if isinstance(o, (str, int)))
    for h in _list(m.get("hosts")):
        if not isinstance(h, str) or not h or _SAFE.search(h) or h in (".", ".."):
            ev.gap(MANIFEST, f"the manifest names a host {str(h)[:80]!r} that is no folder name: ignored")
            continue
        ev.probed_hosts.append(h)
        if not (root / h).is_dir():
            ev.gap(
                h,
                "named in the bundle's manifest, but the bundle has no folder for it: its evidence is missing",
            )


def _read_problem(data: bytes, host: str, ev: Evidence) -> None:
    p = _json(data)
    if isinstance(p, dict):
        ev.host_problems.append(HostProblem(host, str(p.get("kind", "error")), str(p.get("message", ""))))


def _read_errors(data: bytes, host: str, ev: Evidence) -> None:
    for e in _list(_json(data)):
        if isinstance(e, dict):
            ev.gap(f"{host}/{e.get('source')}", str(e.get("message")))
