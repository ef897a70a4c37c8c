"""The Slurm resolver and the node-side collector against a REAL one-node Slurm cluster on this machine.

Needs root and Debian's packages (`apt-get install -y --no-install-recommends slurm-wlm munge`); the module
is skipped with the reason otherwise. Everything runs from a private temporary directory: a generated munge
key and socket, a slurm.conf passed by SLURM_CONF / -f (never /etc/slurm), state and spool dirs, and
munged, slurmctld -D and slurmd -D as this test's children, stopped by PID at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from hangdx.probes import collector
from hangdx.probes.bundle import evidence_from_documents
from hangdx.probes.hosts import HostSpec
from hangdx.probes.resolve import ResolveError, from_slurm, resolve

pytestmark = pytest.mark.slurm

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sbatch", "sinfo", "scancel")
INSTALL = "apt-get install -y --no-install-recommends slurm-wlm munge"

# A rank hung in a collective, as py-spy will show it: a Python process, started by sbatch itself.
JOB_SCRIPT = """#!{python}
import time
def wait_for_allreduce():
    time.sleep(600)
print("rank 0 entering allreduce", flush=True)
wait_for_allreduce()
"""

SLURM_CONF = """\
ClusterName=hangdxtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/run/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=600
MailProg=/bin/true
SlurmctldDebug=info
SlurmdDebug=info
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=100 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str | None:
    """Daemons live in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-n:])
    except OSError:
        return "(no log)"


class Cluster:
    """A one-node Slurm cluster in a temporary directory."""

    def __init__(self) -> None:
        self.host = socket.gethostname().split(".")[0]
        self.dir = tempfile.mkdtemp(prefix="hangdx-slurm-")
        self.daemons: list[subprocess.Popen] = []
        self.jobs: list[str] = []
        self.job_pids: list[int] = []  # the job's processes and their slurmstepd, to make sure they end
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("HANGDX_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK")
        }
        self.env["SLURM_CONF"] = os.path.join(self.dir, "slurm.conf")
        self.startup_seconds = 0.0

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_which(argv[0]) or argv[0], *argv[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=20,
            check=check,
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.path("log", f"{name}.out"), "wb")
        argv = [_which(argv[0]) or argv[0], *argv[1:]]
        proc = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        self.daemons.append(proc)

    def start(self) -> None:
        t0 = time.monotonic()
        # munged wants its socket's directories searchable by all and its key private.
        os.chmod(self.dir, 0o755)
        for sub, mode in (
            ("run", 0o755),
            ("munge", 0o700),
            ("state", 0o700),
            ("spool", 0o755),
            ("log", 0o755),
        ):
            os.mkdir(self.path(sub), mode)
        key = self.path("munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        open(self.path("plugstack.conf"), "w").close()
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(
                SLURM_CONF.format(
                    host=self.host,
                    d=self.dir,
                    ctld_port=_free_port(),
                    slurmd_port=_free_port(),
                    cpus=min(2, os.cpu_count() or 1),
                )
            )
        sock = self.path("run", "munge.sock")
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--log-file={self.path('log', 'munged.log')}",
                f"--pid-file={self.path('run', 'munged.pid')}",
                f"--seed-file={self.path('munge', 'munged.seed')}",
            ],
        )
        self._wait(lambda: os.path.exists(sock), 10, "munged", "munged.out")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.env["SLURM_CONF"]])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.host, "-f", self.env["SLURM_CONF"]])
        self._wait(self._node_idle, 30, "the node", "slurmctld.log")
        self.startup_seconds = time.monotonic() - t0

    def _node_idle(self) -> bool:
        for proc in self.daemons:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with status {proc.returncode}")
        out = self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def _wait(self, ready, timeout: float, what: str, log: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} not ready after {timeout}s: {_tail(self.path('log', log))}")

    def sbatch(self, *args: str) -> str:
        out = self.run(
            "sbatch", "--parsable", f"--chdir={self.dir}", f"--output={self.dir}/job-%j.out", *args
        )
        job = out.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def state(self, job: str) -> str:
        out = self.run("scontrol", "--oneliner", "show", "job", job, check=False).stdout
        for token in out.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
        return "GONE"

    def wait_state(self, job: str, states: set[str], timeout: float = 60) -> str:
        """Wait until Slurm says `job` is in one of `states`. A wait, not a timing check: slurmctld on a machine
        whose 2 cores also run another test stream can take tens of seconds to schedule a job."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in states:
                return state
            time.sleep(0.2)
        detail = self.run("scontrol", "--oneliner", "show", "job", job, check=False).stdout
        reason = next((t for t in detail.split() if t.startswith("Reason=")), "Reason=?")
        node = self.run("sinfo", "-h", "-N", "-o", "%N %T %E", check=False).stdout.strip()
        raise AssertionError(
            f"job {job} still {self.state(job)} ({reason}) after {timeout}s, not {states}; nodes: {node}"
        )

    def stop(self) -> None:
        if self.jobs:
            self.run("scancel", *self.jobs, check=False)
        self._reap(self.job_pids, 10)
        for proc in reversed(self.daemons):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _reap(pids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.2)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root here (slurmd, munged); run as root in a container")
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}): {INSTALL}")
    c = Cluster()
    try:
        c.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        c.stop()
        pytest.skip(f"could not start a one-node Slurm: {e}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = c.env["SLURM_CONF"]  # for from_slurm's own scontrol calls
    try:
        yield c
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        c.stop()


@pytest.fixture(scope="module")
def hung_job(cluster):
    """A running sbatch job whose only process is a Python 'rank' asleep in wait_for_allreduce."""
    script = cluster.path("hung_rank.py")
    with open(script, "w") as f:
        f.write(JOB_SCRIPT.format(python=sys.executable))
    os.chmod(script, 0o755)
    # RANK/WORLD_SIZE as torchrun would set them; SLURM_JOB_ID comes from Slurm, as on a real cluster.
    job = cluster.sbatch("--job-name=hung-rank", "--export=ALL,RANK=0,WORLD_SIZE=1", script)
    cluster.wait_state(job, {"RUNNING"})
    # Wait until the rank has printed (it is then asleep in wait_for_allreduce).
    out = cluster.path(f"job-{job}.out")
    # Under the whole suite's load (two CPUs, many Python processes) the job's interpreter can take a while to
    # start: a generous deadline, and a clear failure if the rank never printed.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "entering allreduce" not in (
        open(out).read() if os.path.exists(out) else ""
    ):
        time.sleep(0.2)
    if "entering allreduce" not in (open(out).read() if os.path.exists(out) else ""):
        pytest.fail(
            f"the sbatch job {job} did not print within 90 s: {cluster.run('squeue', '-j', job, check=False).stdout}"
        )
    procs, _, _ = collector.find_job_processes(job)
    for p in procs:
        cluster.job_pids.extend(x for x in (p["pid"], p["ppid"]) if x and x > 1)
    return job


def test_from_slurm_names_the_node_of_a_running_job(cluster, hung_job):
    assert from_slurm(hung_job) == [HostSpec(name=cluster.host)]
    assert resolve(hung_job, "slurm", timeout=5) == [HostSpec(name=cluster.host)]


def test_unknown_job_is_a_resolve_error_naming_it(cluster):
    with pytest.raises(ResolveError) as e:
        from_slurm("987654")
    assert str(e.value) == "Slurm knows no job 987654"


def test_cancelled_and_completed_jobs_are_not_running(cluster):
    victim = cluster.sbatch("--wrap=sleep 600")
    cluster.wait_state(victim, {"RUNNING"})
    cluster.run("scancel", victim)
    cluster.wait_state(victim, {"CANCELLED"})
    with pytest.raises(ResolveError) as e:
        from_slurm(victim)
    assert str(e.value) == f"job {victim} is CANCELLED, not running"

    done = cluster.sbatch("--wrap=true")
    cluster.wait_state(done, {"COMPLETED"})
    with pytest.raises(ResolveError, match=rf"^job {done} is COMPLETED, not running$"):
        from_slurm(done)


def test_pending_array_task_and_held_job_are_not_running(cluster):
    held = cluster.sbatch("--hold", "--wrap=sleep 600")
    assert cluster.state(held) == "PENDING"
    with pytest.raises(ResolveError, match=rf"^job {held} is PENDING, not running$"):
        from_slurm(held)
    array = cluster.sbatch("--hold", "--array=0-1", "--wrap=sleep 600")
    # The 123_4 form reaches the real scontrol and is understood.
    with pytest.raises(ResolveError, match=rf"^job {array}_1 is PENDING, not running$"):
        from_slurm(f"{array}_1")


def test_collector_finds_the_sbatch_rank_by_slurm_job_id(cluster, hung_job):
    doc = collector.collect(hung_job, samples=1, hardware=False)
    assert doc["errors"] == []
    kinds = {a["kind"] for a in doc["artifacts"]}
    assert {"pyspy", "procstate", "log"} <= kinds
    log = next(a for a in doc["artifacts"] if a["kind"] == "log")
    assert "rank 0 entering allreduce" in log["data"]

    ev = evidence_from_documents([doc], job_id=hung_job)
    assert ev.world_size == 1
    (dump,) = ev.stacks
    assert dump.rank == 0 and dump.host == cluster.host
    assert [f.function for f in dump.main_thread().frames][0] == "wait_for_allreduce"
    states = [s for s in ev.processes if s.rank == 0]
    assert states and states[-1].syscall in ("clock_nanosleep", "nanosleep")
