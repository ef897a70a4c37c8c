"""A simulated multi-node cluster on this one machine, running ONE real multi-node gloo job.

Each node `node-01`, `node-02`, ... is:

- its own PID, mount and UTS namespace, made by `unshare --pid --mount --uts --fork --mount-proc
  --kill-child`, whose PID 1 is `node_init.py`. Inside, /proc shows only the node's processes and
  `hostname` prints the node's name. All nodes share the host's network namespace (gloo ranks on
  different nodes meet at MASTER_ADDR=127.0.0.1 as usual) and its file systems (the job's workdir is
  shared, as on a cluster with a shared file system).
- a real OpenSSH sshd listening on 127.0.0.(10+i):`port` (the same port on every node), with its own host
  key; root logs in with the cluster's key only (StrictModes no, UsePAM no, no passwords).
  `NodeSpec(sshd=False)`: no sshd, so connecting is refused.
- its share of the job's ranks: `python -m hangdx.zoo.job --fault F --workdir W`, with the environment
  hangdx.zoo.launch.ZooJob gives (HANGDX_JOB_ID, global RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR/PORT, GLOO_SOCKET_IFNAME=lo, ...). Global rank = node index * ranks_per_node + local rank.
- its own tool directory `<root>/<node>/bin`, first in the PATH of every SSH session on the node: py-spy
  (the real binary), and stand-ins (tests/cluster/standin.py) for the tools this machine lacks, printing
  the recorded real-format output its NodeSpec gives: nvidia-smi, ibstat, perfquery, dmesg, and `ip link`
  when asked (other `ip` commands run the real ip). sshd sets PATH=<tools>:/usr/local/sbin:/usr/local/bin:
  /usr/sbin:/usr/bin:/sbin:/bin with SetEnv, and inside the node root's ~/.bashrc (which bash reads for
  commands run by sshd) is replaced by one that sets the same PATH, so that the host's own set-up (pyenv
  shims first) does not apply: the stand-ins come before /bin/dmesg, `python3` is the first one on the
  plain PATH. Nothing of the host's file system is hidden (the job's interpreter may live anywhere).

PIDs: `Cluster.pids` maps each global rank to its pid in the root namespace (what `ps` on this machine
shows, what to signal); `Cluster.ns_pids` to its pid inside its node (what the node's /proc, py-spy, a
collector run over SSH, and the stand-ins see). Stand-in text may say `%PID<n>%` (the pid of the node's
local rank n, as the node sees it) and `%HOST%`; nvidia-smi so shows "GPU n runs local rank n" with the
pids the node's collector finds (and drops the lines of dead ranks). NodeSpec.nccl_logs are written,
with the same substitutions, where the ranks' NCCL_DEBUG_FILE (`<root>/nccl/nccl.%h.%p.log`) points.

Stopping: SIGKILL to each node's PID 1 (the kernel then kills every process in that PID namespace: ranks,
DataLoader workers, sshd and its sessions), then reaping unshare; stop() checks /proc that nothing is
left in the nodes' namespaces. unshare gets PR_SET_PDEATHSIG, so the nodes also die if the process that
started them dies without stop() (start clusters from a thread that lives as long as they do).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hangdx.zoo import launch as zoo
from hangdx.zoo.launch import FAULTS, free_port, pid_alive

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SSHD = "/usr/sbin/sshd"
APT_PACKAGES = "openssh-server openssh-client util-linux procps iproute2"
NCCL_FILE = "nccl.%h.%p.log"
_PR_SET_PDEATHSIG = 1


def node_name(i: int) -> str:
    """The name of node i (0-based): node-01, node-02, ..."""
    return f"node-{i + 1:02d}"


def node_address(i: int) -> str:
    """The loopback address node i's sshd listens on: 127.0.0.11, 127.0.0.12, ..."""
    return f"127.0.0.{11 + i}"


def quiet_kernel_log() -> str:
    """A GPU node's boot messages and nothing wrong since (raw `dmesg` format, from the Xid fixture's head)."""
    lines = (FIXTURES / "kernel_log" / "dmesg_xid79.txt").read_text().splitlines()
    return "\n".join(lines[:5]) + "\n"


@dataclass
class ToolOutput:
    """What one run of a stand-in prints, and its exit status."""

    stdout: str
    stderr: str = ""
    returncode: int = 0


@dataclass
class NodeSpec:
    """Which recorded outputs a node's stand-in tools print (None: the node has no such tool)."""

    # First-argument prefix -> output; the longest prefix of the command line wins, "" = no arguments
    # (the table). The collector asks "--query-gpu=..." and "--query-compute-apps=...".
    nvidia_smi: dict[str, str | ToolOutput] | None = None
    ibstat: str | None = None
    # "ca:port" (e.g. "mlx5_0:1") -> successive `perfquery -x -C ca -P port` samples (the collector takes
    # two, 2 s apart); later calls keep every counter rising at its last rate. "*" (or a plain list): the
    # samples of any other port. No -C: the first port. Ports with no samples fail, as RoCE ports do.
    perfquery: dict[str, list[str]] | list[str] | None = None
    # Raw `dmesg` text (`[ seconds.micros] msg`); -T/--ctime print it as real dmesg would, the last line a
    # minute before start(). None: the machine's real dmesg (other jobs' noise included).
    dmesg: str | None = field(default_factory=quiet_kernel_log)
    ip_link: str | None = None  # None: the real `ip link`
    sshd: bool = True  # False: this node's sshd is down (connection refused)
    nccl_logs: dict[int, str] | None = None  # local rank -> its NCCL_DEBUG_FILE's content
    pyspy: bool = True  # False: no py-spy in the node's tool directory (nor elsewhere on its PATH, usually)
    # Tool name -> what it prints whatever its arguments: a node's refusals in the real tools' words (dmesg
    # under kernel.dmesg_restrict, sudo without a rule, journalctl for a user outside systemd-journal).
    # Takes the place of the stand-in of the same name.
    fixed: dict[str, ToolOutput] | None = None
    # `ncclras`: {"text": what `ncclras [-v]` prints, "json": what `ncclras -f json` prints} (NCCL RAS answers
    # for the whole job from any node, so every node of a scenario usually prints the same report).
    ncclras: dict[str, str] | None = None


def unavailable_reason() -> str | None:
    """Why a Cluster cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the simulated cluster needs root (namespaces, sshd as root)"
    for tool in ("unshare", "mount", "ssh", "ssh-keygen", "ps", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y {APT_PACKAGES})"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (apt-get install -y {APT_PACKAGES})"
    try:
        probe = subprocess.run(
            ["unshare", "--pid", "--mount", "--uts", "--fork", "--mount-proc", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if probe.returncode != 0:
        return "cannot create PID/mount/UTS namespaces: " + probe.stderr.decode(errors="replace").strip()
    try:
        with socket.socket() as s:
            s.bind((node_address(0), 0))
    except OSError as e:
        return f"cannot bind {node_address(0)}: {e}"
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL us (unshare) when the thread that started us dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _common_port(addresses: list[str]) -> int:
    """A TCP port free on every one of `addresses`."""
    for _ in range(50):
        port = free_port()
        socks = []
        try:
            for addr in addresses:
                s = socket.socket()
                socks.append(s)
                s.bind((addr, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no TCP port is free on all node addresses")


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _nspid(pid: int) -> int | None:
    """The pid of `pid` inside its innermost PID namespace."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _keygen(path: Path, comment: str) -> tuple[str, str]:
    """A new ed25519 key pair at `path`; returns the public key's (type, base64)."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    kind, b64 = Path(str(path) + ".pub").read_text().split()[:2]
    return kind, b64


class Cluster:
    """N nodes x R ranks of one zoo job; `with Cluster(...) as c:` starts it and stops it."""

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int,
        fault: str = zoo.DEFAULT_FAULT,
        node_specs: dict[int, NodeSpec] | None = None,
        job_id: str | None = None,
    ) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        if nodes < 1 or ranks_per_node < 0 or nodes > 200:
            raise ValueError("need 1..200 nodes")
        if ranks_per_node and nodes * ranks_per_node < 4:  # 0 ranks: bare nodes (the fan-out benchmark)
            raise ValueError("the zoo's faults need a world of at least 4 ranks")
        self.fault = FAULTS[fault]
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.node_specs = {i: (node_specs or {}).get(i) or NodeSpec() for i in range(nodes)}
        self.job_id = job_id or f"cluster-{fault}-{os.urandom(4).hex()}"
        self.hosts = [node_name(i) for i in range(nodes)]
        self.addresses = {node_name(i): node_address(i) for i in range(nodes)}
        self.rank_host = {r: node_name(r // ranks_per_node) for r in range(self.world_size)}
        self.pids: dict[int, int] = {}
        self.ns_pids: dict[int, int] = {}
        self.node_pids: dict[str, int] = {}  # node -> its PID 1, as the root namespace sees it
        self.root = Path(tempfile.mkdtemp(prefix="hangdx-cluster-"))
        self.workdir = self.root / "work"
        self.key_file = str(self.root / "id_ed25519")
        self.known_hosts = str(self.root / "known_hosts")
        self.inventory_file = str(self.root / "inventory.yaml")
        self.port = 0
        self._unshare: dict[str, subprocess.Popen[bytes]] = {}
        # Each node's PID namespace, held open from boot until this object goes: a namespace's inode number is
        # freed with it and the kernel hands it to the next namespace made anywhere on the machine (another
        # test's cluster), whose processes would then read as ours.
        self._namespaces: set[str] = set()
        self._ns_fds: list[int] = []
        weakref.finalize(self, _close_all, self._ns_fds)
        self._started = False
        self._stopped = False

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- start ----------------------------------------------------------------------------------

    def node_dir(self, host: str) -> Path:
        return self.root / host

    def start(self) -> None:
        """Set up keys and nodes, boot every node, wait until each node runs its ranks and its sshd listens."""
        if self._started:
            return
        self._started = True
        atexit.register(self.stop)
        self.workdir.mkdir()
        (self.root / "nccl").mkdir()
        self.port = _common_port(list(self.addresses.values()))
        _keygen(Path(self.key_file), f"hangdx-cluster@{self.job_id}")
        authorized = self.root / "authorized_keys"
        shutil.copy(self.key_file + ".pub", authorized)
        known = []
        # The store's port: rank 0's TCPStore listens on every address (0.0.0.0), so the port must be free on the
        # wildcard, not just on 127.0.0.1, and must not be the nodes' sshd port.
        master_port = self.port
        while master_port == self.port:
            master_port = _common_port(["0.0.0.0"])
        boot_at = time.time()
        try:
            for i, host in enumerate(self.hosts):
                known.append(self._prepare_node(i, host, master_port, authorized, boot_at))
            Path(self.known_hosts).write_text("".join(known))
            self._write_inventory()
            for host in self.hosts:
                self._boot(host)
            self._wait_booted(timeout=max(20.0, 0.5 * self.nodes))
        except BaseException:
            self.stop()
            raise

    def _prepare_node(self, i: int, host: str, master_port: int, authorized: Path, boot_at: float) -> str:
        spec = self.node_specs[i]
        d = self.node_dir(host)
        tools = d / "bin"
        tools.mkdir(parents=True)
        pub = _keygen(d / "ssh_host_ed25519_key", f"root@{host}")
        address = self.addresses[host]
        (d / "sshd_config").write_text(
            f"ListenAddress {address}:{self.port}\n"
            f"HostKey {d / 'ssh_host_ed25519_key'}\n"
            f"AuthorizedKeysFile {authorized}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "UseDNS no\n"
            "PidFile none\n"
            "MaxStartups 200\n"
            "MaxSessions 100\n"
            f"SetEnv PATH={tools}:{SYSTEM_PATH}\n"
        )
        (d / "bashrc").write_text(
            f"# {host}: a plain node's root .bashrc\nexport PATH={tools}:{SYSTEM_PATH}\n"
        )
        self._write_tools(i, host, spec, tools, boot_at)
        ranks = []
        for local in range(self.ranks_per_node):
            rank = i * self.ranks_per_node + local
            ranks.append(
                {
                    "rank": rank,
                    "local_rank": local,
                    "env": self._rank_env(rank, local, master_port, any_nccl=self._any_nccl()),
                    "log": str(self.workdir / f"rank{rank}.log"),
                }
            )
        plan = {
            "name": host,
            "node_dir": str(d),
            "bashrc": str(d / "bashrc"),
            "sshd_config": str(d / "sshd_config") if spec.sshd else None,
            "ranks": ranks,
            "scrub_env": list(zoo._SCRUBBED_ENV),
            "cmd": [
                sys.executable,
                "-m",
                "hangdx.zoo.job",
                "--fault",
                self.fault.name,
                "--workdir",
                str(self.workdir),
            ],
            "workdir": str(self.workdir),
            "nccl_file": str(self.root / "nccl" / NCCL_FILE) if self._any_nccl() else None,
            "nccl_logs": {str(k): v for k, v in (spec.nccl_logs or {}).items()},
        }
        (d / "plan.json").write_text(json.dumps(plan, indent=1))
        return f"[{address}]:{self.port},[{host}]:{self.port} {pub[0]} {pub[1]}\n"

    def _any_nccl(self) -> bool:
        return any(s.nccl_logs for s in self.node_specs.values())

    def _rank_env(self, rank: int, local: int, master_port: int, any_nccl: bool) -> dict[str, str]:
        env = dict(zoo._FAULT_ENV.get(self.fault.name, {}))
        env.update(
            HANGDX_JOB_ID=self.job_id,
            RANK=str(rank),
            LOCAL_RANK=str(local),
            GROUP_RANK=str(rank // self.ranks_per_node),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.ranks_per_node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        if any_nccl:
            env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=str(self.root / "nccl" / NCCL_FILE))
        return env

    def _write_tools(self, i: int, host: str, spec: NodeSpec, tools: Path, boot_at: float) -> None:
        doc: dict[str, object] = {"host": host}
        names = []
        if spec.nvidia_smi is not None:
            doc["nvidia-smi"] = {
                k: (v if isinstance(v, ToolOutput) else ToolOutput(v)).__dict__
                for k, v in spec.nvidia_smi.items()
            }
            names.append("nvidia-smi")
        if spec.ibstat is not None:
            doc["ibstat"] = spec.ibstat
            names.append("ibstat")
        if spec.perfquery is not None:
            doc["perfquery"] = spec.perfquery if isinstance(spec.perfquery, dict) else {"*": spec.perfquery}
            names.append("perfquery")
        if spec.dmesg is not None:
            doc["dmesg"] = {"text": spec.dmesg, "boot": boot_at - 60 - _last_uptime(spec.dmesg)}
            names.append("dmesg")
        if spec.ip_link is not None:
            real_ip = shutil.which("ip") or "/usr/sbin/ip"
            doc["ip"] = {"text": spec.ip_link, "real": os.path.realpath(real_ip)}
            names.append("ip")
        if spec.ncclras is not None:
            doc["ncclras"] = spec.ncclras
            names.append("ncclras")
        (self.node_dir(host) / "tools.json").write_text(json.dumps(doc, indent=1))
        for name in names:
            wrapper = tools / name
            wrapper.write_text(
                f"#!{sys.executable} -S\n"
                "import sys\n"
                f"sys.path.insert(0, {str(HERE)!r})\n"
                "import standin\n"
                f"sys.exit(standin.main({name!r}, {str(self.node_dir(host))!r}, sys.argv[1:]))\n"
            )
            wrapper.chmod(0o755)
        for name, out in (spec.fixed or {}).items():
            wrapper = tools / name
            wrapper.write_text(
                f"#!{sys.executable} -S\n"
                "import sys\n"
                f"sys.stdout.write({out.stdout!r})\n"
                f"sys.stderr.write({out.stderr!r})\n"
                f"sys.exit({int(out.returncode)})\n"
            )
            wrapper.chmod(0o755)
        pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if spec.pyspy and os.path.exists(pyspy):
            # The real binary, not a pyenv shim: shims need the host's shell set-up.
            pyspy = os.path.join(os.path.dirname(sys.executable), "py-spy") if "shims" in pyspy else pyspy
            (tools / "py-spy").symlink_to(os.path.realpath(pyspy))

    def _write_inventory(self) -> None:
        doc = {
            "jobs": {self.job_id: {"hosts": list(self.hosts)}},
            "hosts": {
                h: {
                    "address": self.addresses[h],
                    "port": self.port,
                    "user": "root",
                    "key_file": self.key_file,
                }
                for h in self.hosts
            },
            "ssh": {"known_hosts": self.known_hosts, "key_file": self.key_file},
        }
        Path(self.inventory_file).write_text(yaml.safe_dump(doc, sort_keys=False))

    def _boot(self, host: str) -> None:
        d = self.node_dir(host)
        with open(d / "init.log", "wb") as log:
            self._unshare[host] = subprocess.Popen(
                [
                    "unshare",
                    "--pid",
                    "--mount",
                    "--uts",
                    "--fork",
                    "--mount-proc",
                    "--propagation",
                    "private",
                    "--kill-child",
                    sys.executable,
                    str(HERE / "node_init.py"),
                    str(d / "plan.json"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )

    def _wait_booted(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        pending = set(self.hosts)
        while pending:
            for host in sorted(pending):
                proc = self._unshare[host]
                if proc.poll() is not None:
                    raise RuntimeError(f"{host} died while booting:\n{self._node_log(host, 'init.log')}")
                if host not in self.node_pids:
                    child = next((p for p in _children(proc.pid)), None)
                    if child is None:
                        continue
                    self.node_pids[host] = child
                    ns = _pid_ns(child)
                    if ns:
                        with contextlib.suppress(OSError):
                            self._ns_fds.append(os.open(f"/proc/{child}/ns/pid", os.O_RDONLY | os.O_CLOEXEC))
                            # Read again with the namespace held: the child may have died in between.
                            if _pid_ns(child) == ns:
                                self._namespaces.add(ns)
                if not (self.node_dir(host) / "ranks.json").exists():
                    continue
                if not self._map_pids(host):
                    continue
                i = self.hosts.index(host)
                if self.node_specs[i].sshd and not _listening(self.addresses[host], self.port):
                    continue
                pending.discard(host)
            if pending and time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {h}\n{self._node_log(h, 'init.log')}{self._node_log(h, 'sshd.log')}"
                    for h in pending
                )
                raise TimeoutError(f"nodes not up after {timeout:.0f} s: {sorted(pending)}\n{logs}")
            if pending:
                time.sleep(0.05)

    def _map_pids(self, host: str) -> bool:
        """Fill pids/ns_pids for the host's ranks from its ranks.json and the root namespace's /proc."""
        doc = json.loads((self.node_dir(host) / "ranks.json").read_text())
        init = self.node_pids[host]
        by_ns = {_nspid(p): p for p in _children(init)}
        for rank, ns_pid in doc["rank_pids"].items():
            root_pid = by_ns.get(ns_pid)
            if root_pid is None:
                return False
            self.pids[int(rank)] = root_pid
            self.ns_pids[int(rank)] = ns_pid
        return True

    def _node_log(self, host: str, name: str) -> str:
        try:
            return (self.node_dir(host) / name).read_text(errors="replace")
        except OSError:
            return ""

    # --- running ----------------------------------------------------------------------------------

    def log(self, rank: int) -> str:
        """What the rank printed (stdout and stderr)."""
        try:
            return (self.workdir / f"rank{rank}.log").read_text(errors="replace")
        except OSError:
            return ""

    def _tails(self, lines: int = 15) -> str:
        parts = []
        for rank in range(self.world_size):
            tail = "\n".join(self.log(rank).splitlines()[-lines:])
            parts.append(f"--- rank {rank} on {self.rank_host[rank]} (pid {self.pids.get(rank)}) ---\n{tail}")
        return "\n".join(parts)

    def alive(self) -> dict[int, bool]:
        """rank -> whether its process is still running (zombies count as gone)."""
        return {rank: pid_alive(pid) for rank, pid in self.pids.items()}

    def _ready(self) -> bool:
        return zoo.reached_fault(self.workdir, self.fault, self.world_size, lambda r: pid_alive(self.pids[r]))

    def wait_until_stuck(self, timeout: float = 120) -> None:
        """Block until every rank sits where the fault leaves it (straggler: until every rank did 3 steps)."""
        if not self._started:
            raise RuntimeError("wait_until_stuck() before start()")
        deadline = time.monotonic() + timeout
        expected_dead = zoo._KILLED_RANK.get(self.fault.name)
        while not self._ready():
            for rank, pid in self.pids.items():
                if rank != expected_dead and not pid_alive(pid):
                    raise RuntimeError(
                        f"{self.job_id}: rank {rank} on {self.rank_host[rank]} exited before the job got "
                        f"stuck\n{self._tails()}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.job_id}: not stuck after {timeout:.0f} s\n{self._tails()}")
            time.sleep(0.2)
        time.sleep(1.0)  # the marker comes just before the blocking call: let every rank get into it

    def ssh_argv(self, host: str, command: str, *options: str) -> list[str]:
        """The plain OpenSSH command line that runs `command` on `host` as root (host key checked)."""
        return [
            "ssh",
            "-F",
            "/dev/null",  # none of this machine's ssh configuration
            "-i",
            self.key_file,
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "IdentityAgent=none",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "LogLevel=ERROR",
            *options,
            "-p",
            str(self.port),
            f"root@{self.addresses[host]}",
            command,
        ]

    def ssh(
        self, host: str, command: str, timeout: float = 30, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` on `host` over SSH; stdout/stderr as text."""
        return subprocess.run(
            self.ssh_argv(host, command),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=None if input is not None else subprocess.DEVNULL,
        )

    # --- stop ---------------------------------------------------------------------------------------

    def leftovers(self) -> list[int]:
        """Processes (root-namespace pids) still alive in any of the nodes' PID namespaces."""
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _pid_ns(int(entry)) in self._namespaces and pid_alive(int(entry)):
                left.append(int(entry))
        return left

    def stop(self) -> None:
        """SIGKILL every node's PID 1 (the kernel kills the rest of the node), reap, check, clean up."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        for host, proc in self._unshare.items():
            init = self.node_pids.get(host)
            # While unshare lives (we have not reaped it), its child is still the node's PID 1.
            if init is not None and proc.poll() is None and _ppid(init) == proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)
        for proc in self._unshare.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.leftovers()
        shutil.rmtree(self.root, ignore_errors=True)
        if left:
            raise RuntimeError(
                f"{self.job_id}: processes left in the nodes' namespaces: {[_describe(p) for p in left]}"
            )


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _describe(pid: int) -> str:
    """`pid (comm) state S wchan W ppid P`: what a process that outlived its node was doing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
    except (OSError, ValueError):
        return f"{pid} (gone)"
    return f"{pid} ({comm}) state {state} wchan {wchan} ppid {ppid}"


def _children(pid: int) -> list[int]:
    """Live children of `pid` (root-namespace pids)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return [int(e) for e in os.listdir("/proc") if e.isdigit() and _ppid(int(e)) == pid]


def _listening(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def _last_uptime(dmesg: str) -> float:
    """The timestamp (seconds since boot) of the last raw dmesg line; 0 when there is none."""
    last = 0.0
    for line in dmesg.splitlines():
        if line.startswith("[") and "]" in line:
            with contextlib.suppress(ValueError):
                last = float(line[1 : line.index("]")])
    return last


__all__ = [
    "Cluster",
    "NodeSpec",
    "ToolOutput",
    "node_address",
    "node_name",
    "quiet_kernel_log",
    "unavailable_reason",
]
