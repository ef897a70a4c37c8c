"""Acting on what a verdict found, in Slurm: drain a node, requeue or cancel a job.

Never a shell: each action is one argument list (`scontrol update NodeName=... State=DRAIN Reason=...`,
`scontrol requeue JOB`, `scancel JOB`), run with a timeout, on a validated node name or job id. Who may act is
separate from who may diagnose (HANGDX_ACTION_USERS, HANGDX_ACTION_GROUPS; bot/access.py); the Slack buttons ask
for confirmation, the command line is for whoever can already run scontrol.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from hangdx.bot.diagnosis import DiagnosisError, check_job_id

NODE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")  # a Slurm node name: never a leading dash (an option)
# Names scontrol reads as more than one node: `ALL` (any case) is every node of the cluster.
_KEYWORDS = {"all", "default"}
TIMEOUT = 20
ACTIONS = ("drain", "requeue", "cancel")


class ActionError(Exception):
    """An action hangdx will not run, or that Slurm refused: one line."""


def _run(argv: list[str], keep: bool = False) -> str:
    """Run one argument list; its output in one line (`keep`: as printed)."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise ActionError(f"{argv[0]} not found on this host: Slurm actions need the Slurm client commands")
    try:
        r = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ActionError(f"{' '.join(argv[:2])} did not answer within {TIMEOUT} s") from None
    said = " ".join((r.stderr or r.stdout or "").split())[:300]
    if r.returncode != 0:
        raise ActionError(f"{' '.join(argv[:2])} failed: {said or f'exit status {r.returncode}'}")
    return r.stdout if keep else said


def _reason(text: str) -> str:
    # Slurm keeps the reason as given; keep it one printable line.
    return "".join(c for c in " ".join(text.split()) if c.isprintable())[:200] or "hangdx"


def looks_like_node(name: str) -> bool:
    """Whether `name` could be one Slurm node (its form only; check_node asks Slurm)."""
    return isinstance(name, str) and bool(NODE.fullmatch(name)) and name.lower() not in _KEYWORDS


def _lines(argv: list[str]) -> list[str]:
    return [ln.strip() for ln in _run(argv, keep=True).splitlines() if ln.strip()]


def cluster_nodes() -> set[str]:
    """Every node Slurm lists, one name each (`sinfo -N`): what a node name must be to be acted on."""
    return set(_lines(["sinfo", "-N", "-h", "-o", "%N"]))


def job_nodes(job: str) -> set[str]:
    """The nodes Slurm says job `job` runs on (its NodeList expanded by `scontrol show hostnames`); empty when
    it runs nowhere now (pending, finished)."""
    nodelist = " ".join(_lines(["squeue", "-h", "-j", _job(job), "-o", "%N"]))
    if not nodelist or nodelist in ("(null)", "None"):
        return set()
    return set(_lines(["scontrol", "show", "hostnames", nodelist]))


def check_node(node: str, job: str | None = None) -> str:
    """`node` when it is one node Slurm itself lists (of job `job`, while the job runs somewhere), else
    ActionError: never a keyword (`ALL` is every node), a NodeSet, a range or a list."""
    if not isinstance(node, str) or not NODE.fullmatch(node):
        raise ActionError(f"{str(node)[:80]!r} is not a node name")
    if not looks_like_node(node):
        raise ActionError(
            f"{node!r} is a Slurm keyword for many nodes, not a node: hangdx drains one node at a time"
        )
    if node not in cluster_nodes():
        raise ActionError(
            f"{node!r} is not a node Slurm lists (sinfo -N): hangdx drains only a node of the cluster"
        )
    if job is not None:
        nodes = job_nodes(job)
        if nodes and node not in nodes:
            raise ActionError(
                f"{node!r} is not a node of job {job} (Slurm runs it on {', '.join(sorted(nodes)[:8])})"
            )
    return node


def drain(node: str, reason: str, job: str | None = None) -> str:
    """Drain one node Slurm lists (of job `job` when given); said in one line."""
    node = check_node(node, job)
    _run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={_reason(reason)}"])
    return f"node {node} drained (reason: {_reason(reason)})"


def _job(job: str) -> str:
    try:
        check_job_id(job)
    except DiagnosisError as e:
        raise ActionError(str(e)) from None
    if not re.fullmatch(r"[0-9]+(?:_[0-9]+)?", job):
        raise ActionError(f"{job!r} is not a Slurm job id")
    return job


KNOWS_TIMEOUT = 5  # a verdict waits for this answer: short, and "no" when Slurm does not answer


def knows_job(job: str) -> bool:
    """Whether Slurm knows job `job` (`scontrol show job`: running, pending or lately ended): only then does a
    verdict offer Slurm's buttons. False for an id that is not Slurm's form, without Slurm's client commands, or
    when Slurm does not answer."""
    if not isinstance(job, str) or not re.fullmatch(r"[0-9]+(?:_[0-9]+)?", job):
        return False
    exe = shutil.which("scontrol")
    if exe is None:
        return False
    try:
        r = subprocess.run(
            [exe, "show", "job", "-o", job], capture_output=True, text=True, timeout=KNOWS_TIMEOUT
        )
    except (subprocess.TimeoutExpired, OSError):
        return False
    # An array task (`123_4`) is JobId=125 ArrayJobId=123 ArrayTaskId=4.
    return r.returncode == 0 and re.search(rf"\b(?:Array)?JobId={job.split('_')[0]}\b", r.stdout) is not None


def requeue(job: str) -> str:
    _run(["scontrol", "requeue", _job(job)])
    return f"job {job} requeued"


def cancel(job: str) -> str:
    _run(["scancel", _job(job)])
    return f"job {job} cancelled"


def run(action: str, job: str, node: str | None, who: str) -> str:
    """One action for incident `job`, said in one line; ActionError when refused or failed."""
    if action == "drain":
        if not node:
            raise ActionError("this verdict names no node to drain")
        return drain(node, f"hangdx: job {job}, drained by {who}", job=job)
    if action == "requeue":
        return requeue(job)
    if action == "cancel":
        return cancel(job)
    raise ActionError(f"unknown action {action!r}")
