"""Live diagnosis on this machine (`--local`): the node-side collector, run in-process, no SSH."""

from __future__ import annotations

import socket

from hangdx.probes import bundle, collector
from hangdx.probes.model import Evidence


class JobNotFound(Exception):
    """No process of the job on the probed hosts."""


def collect_local(job_id: str, samples: int = 3, interval: float = 0.7) -> list[dict]:
    """Collector documents for job_id on this host (one document: this host)."""
    doc = collector.collect(job_id, samples=samples, interval=interval, host=socket.gethostname())
    return [doc]


def evidence_for_job(docs: list[dict], job_id: str) -> Evidence:
    found = any(a.get("kind") in ("procstate", "pyspy") for d in docs for a in d.get("artifacts") or [])
    # A host that could not be probed is evidence (it may be the dead node), not an unknown job.
    if not found and not any(d.get("problem") for d in docs):
        hosts = ", ".join(str(d.get("host")) for d in docs)
        others = sorted({o for d in docs for o in d.get("other_jobs") or []})
        seen = (
            f"jobs seen there: {', '.join(others[:10])}" if others else "no job processes seen there at all"
        )
        errors = [
            e.get("message") for d in docs for e in d.get("errors") or [] if e.get("source") == "processes"
        ]
        extra = f" ({errors[0]})" if errors else ""
        raise JobNotFound(
            f"no process of job {job_id!r} found on {hosts} ({seen}); a process belongs to a job when its "
            f"environment has SLURM_JOB_ID, TORCHELASTIC_RUN_ID or HANGDX_JOB_ID equal to it{extra}"
        )
    return bundle.evidence_from_documents(docs, job_id=job_id)
