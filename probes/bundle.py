"""Bundles: the raw artifacts of one diagnosis, as collector documents or as a folder of files.

A bundle folder holds `manifest.json` and one sub-folder per host with the artifacts as the
collector brought them, so that `hangdx analyze DIR` reads exactly what the live run read.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from hangdx.probes.model import Evidence, HostProblem, Source
from hangdx.probes.naming import host_from_path, rank_from_name
from hangdx.probes.registry import parse_artifact
from hangdx.probes.text import looks_binary

MANIFEST = "manifest.json"
MAX_FILE_BYTES = 512 * 1024 * 1024
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def artifact_bytes(artifact: dict) -> bytes:
    data = artifact.get("data") or ""
    # Binary artifacts (Flight Recorder pickles) travel as latin-1 text inside the JSON document.
    return data.encode("latin-1", "replace") if artifact.get("kind") == "flight_recorder" else data.encode()


def evidence_from_documents(docs: list[dict], job_id: str | None = None) -> Evidence:
    """Parse collector documents (one per host) into Evidence."""
    ev = Evidence(job_id=job_id, live=True)
    for doc in docs:
        host = doc.get("host")
        if host and host not in ev.probed_hosts:
            ev.probed_hosts.append(host)
        problem = doc.get("problem")
        if isinstance(problem, dict):
            ev.host_problems.append(
                HostProblem(str(host), str(problem.get("kind", "error")), str(problem.get("message", "")))
            )
        else:
            ev.note_host(host)
        for err in doc.get("errors") or []:
            ev.gap(f"{host}/{err.get('source')}", str(err.get("message")))
        for other in doc.get("other_jobs") or []:
            if other not in ev.other_jobs:
                ev.other_jobs.append(other)
        for art in doc.get("artifacts") or []:
            src = Source(f"{host}/{art.get('name')}", host=host, rank=art.get("rank"), pid=art.get("pid"))
            kind = art.get("kind")
            # A rank's own stdout/stderr is read only for what a parser recognises in it.
            parse_artifact(
                artifact_bytes(art), src, ev, kind=None if kind == "log" else kind, quiet=kind == "log"
            )
    return ev


def save(docs: list[dict], directory: str | Path, job_id: str | None) -> Path:
    """Write collector documents as a bundle folder."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    hosts = []
    for doc in docs:
        host = _SAFE.sub("_", str(doc.get("host") or "unknown-host"))
        hosts.append(host)
        (root / host).mkdir(exist_ok=True)
        for art in doc.get("artifacts") or []:
            name = _SAFE.sub("_", str(art.get("name") or "artifact"))
            (root / host / name).write_bytes(artifact_bytes(art))
        if doc.get("errors"):
            (root / host / "errors.json").write_text(json.dumps(doc["errors"], indent=1))
        if doc.get("problem"):
            (root / host / "problem.json").write_text(json.dumps(doc["problem"], indent=1))
    manifest = {
        "hangdx_bundle": 1,
        "job_id": job_id,
        "hosts": hosts,
        "created": time.time(),
        "other_jobs": sorted({o for d in docs for o in d.get("other_jobs") or []}),
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return root


def _walk(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return out


class InputError(Exception):
    """A path the user gave cannot be read (exit status 2)."""


def evidence_from_paths(paths: list[str], stdin: bytes | None = None) -> Evidence:
    """Parse files, folders and bundles (and `-` for standard input) into Evidence."""
    ev = Evidence()
    for p in paths:
        if p == "-":
            parse_artifact(stdin or b"", Source("<stdin>"), ev)
            continue
        path = Path(p)
        if not path.exists():
            raise InputError(f"{p}: no such file or directory")
        if not os.access(path, os.R_OK):
            raise InputError(f"{p}: permission denied")
        base = path if path.is_dir() else path.parent
        manifest = path / MANIFEST if path.is_dir() else None
        if manifest is not None and manifest.is_file():
            _read_manifest(manifest, ev)
        for f in _walk(path):
            if f.name in (MANIFEST,):
                continue
            rel = f.relative_to(base).as_posix() if f != path else f.name
            if f.name == "errors.json" and manifest is not None:
                _read_errors(f, rel, ev)
                continue
            if f.name == "problem.json" and manifest is not None:
                _read_problem(f, ev)
                continue
            try:
                size = f.stat().st_size
                if size > MAX_FILE_BYTES:
                    with f.open("rb") as fh:
                        fh.seek(size - MAX_FILE_BYTES)
                        data = fh.read()
                else:
                    data = f.read_bytes()
            except OSError as e:
                ev.gap(rel, f"unreadable: {e.strerror}")
                continue
            host = host_from_path(rel)
            src = Source(rel, host=host, rank=rank_from_name(f.name))
            if data and looks_binary(data[:8192]) and not data.startswith(b"\x80"):
                ev.gap(rel, f"binary file of {len(data)} bytes, not an artifact hangdx reads: skipped")
                continue
            parse_artifact(data, src, ev)
    return ev


def _read_manifest(path: Path, ev: Evidence) -> None:
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        ev.gap(str(path), "bundle manifest unreadable")
        return
    if isinstance(m, dict):
        ev.job_id = ev.job_id or m.get("job_id")
        ev.probed_hosts = [str(h) for h in m.get("hosts") or []]
        ev.live = True  # a saved bundle is a live probe, read later
        for o in m.get("other_jobs") or []:
            ev.other_jobs.append(str(o))


def _read_problem(path: Path, ev: Evidence) -> None:
    try:
        p = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(p, dict):
        ev.host_problems.append(
            HostProblem(path.parent.name, str(p.get("kind", "error")), str(p.get("message", "")))
        )


def _read_errors(path: Path, rel: str, ev: Evidence) -> None:
    try:
        errs = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    host = path.parent.name
    for e in errs if isinstance(errs, list) else []:
        if isinstance(e, dict):
            ev.gap(f"{host}/{e.get('source')}", str(e.get("message")))
