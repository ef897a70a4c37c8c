"""The simulated cluster itself, checked from outside with the plain OpenSSH client: each node answers on
its own loopback address with its own name, sees only its own ranks, and its stand-in tools print the
scenario's recorded output with the pids the node sees. Each cluster test runs one real gloo job
(4 ranks over 2 or 4 nodes, ~10-20 s); the stand-in tests at the end need no cluster.

Needs root, util-linux `unshare`, and OpenSSH (CI: `apt-get update && apt-get install -y openssh-server
openssh-client`); skipped with the reason otherwise. Recorded formats: see tests/fixtures/*/README.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from . import scenarios
from .sim import Cluster, unavailable_reason

COLLECTOR = Path(__file__).resolve().parents[2] / "probes" / "collector.py"
_REASON = unavailable_reason()
pytestmark = [
    pytest.mark.zoo,
    pytest.mark.skipif(_REASON is not None, reason=f"simulated cluster unavailable: {_REASON}"),
]


@contextlib.contextmanager
def running(scenario: scenarios.Scenario) -> Iterator[Cluster]:
    """Start the scenario's cluster, wait until the job is stuck; afterwards check nothing is left."""
    pytest.importorskip("torch")
    cluster = scenario.cluster()
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.wait_until_stuck(timeout=120)
        cluster.startup_seconds = time.monotonic() - t0  # type: ignore[attr-defined]
        yield cluster
    finally:
        cluster.stop()
    _assert_all_gone(cluster)


def _assert_all_gone(cluster: Cluster) -> None:
    assert cluster.leftovers() == []
    ours = [p for p in [*cluster.pids.values(), *cluster.node_pids.values()] if os.path.exists(f"/proc/{p}")]
    for pid in ours:  # a pid may have been reused since: then it is not one of our job's processes
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes()
            assert f"HANGDX_JOB_ID={cluster.job_id}".encode() not in env, f"pid {pid} of the job survived"
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                env = Path(f"/proc/{entry}/environ").read_bytes()
                assert f"HANGDX_JOB_ID={cluster.job_id}\0".encode() not in env, f"pid {entry} survived"
    for address in cluster.addresses.values():
        with pytest.raises(OSError), socket.create_connection((address, cluster.port), timeout=1):
            pass
    assert not cluster.root.exists()


def sh(cluster: Cluster, host: str, command: str, input: str | None = None) -> str:
    r = cluster.ssh(host, command, input=input, timeout=60)
    assert r.returncode == 0, f"{host}: {command!r} exited {r.returncode}: {r.stderr}"
    return r.stdout


def node_ranks(cluster: Cluster, host: str) -> dict[int, int]:
    """rank -> pid as the node sees it, for the ranks the cluster put on `host`."""
    return {r: cluster.ns_pids[r] for r, h in cluster.rank_host.items() if h == host}


def job_processes(cluster: Cluster, host: str) -> tuple[set[int], set[int]]:
    """From `ps -e` on the node: (pids of rank processes, pids of their children), zoo job processes only."""
    ranks, children = set(), set()
    for line in sh(cluster, host, "ps -e -o pid=,ppid=,args=").splitlines():
        pid, ppid, args = line.split(None, 2)
        if "hangdx.zoo.job" in args:
            (ranks if ppid == "1" else children).add(int(pid))
    return ranks, children


def rank_env(cluster: Cluster, host: str, pid: int) -> dict[str, str]:
    out = sh(cluster, host, f"tr '\\0' '\\n' < /proc/{pid}/environ")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def check_nodes(cluster: Cluster, hosts: list[str] | None = None) -> None:
    """Every node: its name, only its own ranks in ps, each rank's global RANK/LOCAL_RANK/WORLD_SIZE."""
    for host in hosts or cluster.hosts:
        assert sh(cluster, host, "hostname").strip() == host
        mine = node_ranks(cluster, host)
        alive = {r: p for r, p in mine.items() if cluster.alive()[r]}
        ranks, _ = job_processes(cluster, host)
        assert ranks == set(alive.values()), f"{host}: ps shows {ranks}, expected {alive}"
        for rank, pid in alive.items():
            env = rank_env(cluster, host, pid)
            assert env["HANGDX_JOB_ID"] == cluster.job_id
            assert env["RANK"] == str(rank)
            assert env["LOCAL_RANK"] == str(rank % cluster.ranks_per_node)
            assert env["WORLD_SIZE"] == str(cluster.world_size)
            assert env["LOCAL_WORLD_SIZE"] == str(cluster.ranks_per_node)
            assert env["MASTER_ADDR"] == "127.0.0.1"
    # The root-namespace pids are the same processes, seen from outside.
    for rank, pid in cluster.pids.items():
        if not cluster.alive()[rank]:
            continue
        status = Path(f"/proc/{pid}/status").read_text()
        nspid = re.search(r"^NSpid:\s+(.*)$", status, re.M).group(1).split()  # type: ignore[union-attr]
        assert [int(x) for x in nspid] == [pid, cluster.ns_pids[rank]]


def csv_rows(text: str) -> list[list[str]]:
    return [line.split(", ") for line in text.strip().splitlines()[1:]]


# --- scenario 1: one GPU idle among busy ones -----------------------------------------------------------


def test_gpu_idle_nodes_show_their_ranks_and_gpus() -> None:
    scenario = scenarios.gpu_idle()
    with running(scenario) as c:
        assert c.startup_seconds < 60  # type: ignore[attr-defined]
        assert c.hosts == ["node-01", "node-02"]
        assert c.addresses == {"node-01": "127.0.0.11", "node-02": "127.0.0.12"}
        assert c.rank_host == {0: "node-01", 1: "node-01", 2: "node-02", 3: "node-02"}
        check_nodes(c)
        for host in c.hosts:
            gpus = csv_rows(sh(c, host, f"nvidia-smi {scenarios.QUERY_GPU} --format=csv"))
            utils = {int(row[0]): row[4] for row in gpus}
            assert utils == ({0: "100 %", 1: "0 %"} if host == "node-01" else {0: "100 %", 1: "100 %"})
            # GPU i runs local rank i, with the pid the node sees.
            apps = csv_rows(sh(c, host, f"nvidia-smi {scenarios.QUERY_APPS} --format=csv"))
            mine = node_ranks(c, host)
            assert {int(row[0]): row[3] for row in apps} == {mine[r]: gpus[r % 2][2] for r in mine}
            tools = c.node_dir(host) / "bin"
            found = sh(c, host, "command -v nvidia-smi dmesg py-spy perfquery ibstat ip").split()
            assert found == [
                str(tools / t) for t in ("nvidia-smi", "dmesg", "py-spy", "perfquery", "ibstat", "ip")
            ]
            table = sh(c, host, "nvidia-smi")
            assert "NVIDIA-SMI 535.161.08" in table
            for r, pid in mine.items():
                assert re.search(rf"^\|\s+{r % 2}\s+N/A\s+N/A\s+{pid}\s+C\s", table, re.M)
        assert scenario.expected == {
            "category": "conditional_collective",
            "ranks": [1],
            "hosts": ["node-01"],
            "gpus": ["node-01:0000:2a:00.0"],
        }


def test_collector_over_plain_ssh_sees_only_its_node() -> None:
    """The real node-side collector, piped to `python3 -` over ssh, finds that node's ranks and stand-ins."""
    with running(scenarios.gpu_idle()) as c:
        out = sh(
            c, "node-02", f"python3 - {c.job_id} --samples 2 --interval 0.3", input=COLLECTOR.read_text()
        )
        doc = json.loads(out)
        assert doc["host"] == "node-02"
        stacks = {a["rank"]: a for a in doc["artifacts"] if a["kind"] == "pyspy"}
        assert set(stacks) == {2, 3}
        assert {r: a["pid"] for r, a in stacks.items()} == node_ranks(c, "node-02")
        assert "log_metrics" in stacks[2]["data"]  # py-spy really ran on the node's rank
        kinds = {a["name"]: a for a in doc["artifacts"]}
        assert "100 %" in kinds["nvidia-smi.csv"]["data"]
        assert str(c.ns_pids[3]) in kinds["nvidia-smi-apps.csv"]["data"]
        perf = kinds["perfquery.txt"]["data"]
        assert len(re.findall(r"(?m)^# hangdx sample .* ca=mlx5_0 port=1$", perf)) == 2
        assert "SymbolErrorCounter:..............0" in perf
        assert "mlx5_0: Port: 1 Link ACTIVE" in kinds["kernel.log"]["data"]
        assert "ens3np0" in kinds["ip-link.txt"]["data"]


# --- scenario 2: a loose InfiniBand cable -------------------------------------------------------------------


def test_ib_link_flap_node_shows_port_down_rising_counters_and_nccl_errors() -> None:
    scenario = scenarios.ib_link_flap()
    assert scenario.expected["links"] == ["node-02:mlx5_0/1"]
    with running(scenario) as c:
        check_nodes(c)
        assert c.alive() == {0: True, 1: True, 2: False, 3: True}
        bad = sh(c, "node-02", "ibstat mlx5_0")
        assert "State: Down" in bad and "Physical state: Polling" in bad
        assert "State: Active" in sh(c, "node-01", "ibstat mlx5_0")
        assert sh(c, "node-02", "ibstat -l").split() == [f"mlx5_{i}" for i in range(10)]

        def symbol_errors(host: str) -> int:
            out = sh(c, host, "perfquery -x -C mlx5_0 -P 1")
            return int(re.search(r"^SymbolErrorCounter:\.+(\d+)$", out, re.M).group(1))  # type: ignore[union-attr]

        first, second, third = (symbol_errors("node-02") for _ in range(3))
        assert (first, second) == (1204, 1587)
        assert third == 1587 + (1587 - 1204)  # still rising on later calls
        assert {symbol_errors("node-01") for _ in range(3)} == {0}
        roce = c.ssh("node-02", "perfquery -x -C mlx5_4 -P 1")
        assert roce.returncode != 0 and "Failed to open 'mlx5_4' port '1'" in roce.stderr

        kernel = sh(c, "node-02", "dmesg --ctime")
        downs = [line for line in kernel.splitlines() if "mlx5_0: Port: 1 Link DOWN" in line]
        assert len(downs) == 2
        assert re.match(r"^\[\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\] mlx5_core 0000:0c:00.0 ", downs[-1])
        assert "Link DOWN" not in sh(c, "node-01", "dmesg --ctime")

        # The NCCL log of rank 3 (alive, on node-02) sits where its NCCL_DEBUG_FILE says, named by host and pid.
        pid3 = c.ns_pids[3]
        pattern = rank_env(c, "node-02", pid3)["NCCL_DEBUG_FILE"]
        path = pattern.replace("%h", "node-02").replace("%p", str(pid3))
        log = sh(c, "node-02", f"cat {path}")
        assert f"node-02:{pid3}:{pid3} [1] NCCL INFO comm 0x561dde2fb110 rank 3 nRanks 4 nNodes 2" in log
        assert re.search(
            rf"node-02:{pid3}:{pid3 + 91} \[1\] transport/net_ib/p2p.cc:550 NCCL WARN .* hca mlx5_0$",
            log,
            re.M,
        )
        assert "NCCL WARN" not in sh(
            c, "node-01", f"cat {pattern.replace('%h', 'node-01').replace('%p', str(c.ns_pids[0]))}"
        )

        # The dead rank's GPU process is gone from nvidia-smi; its GPU sits idle.
        apps = csv_rows(sh(c, "node-02", f"nvidia-smi {scenarios.QUERY_APPS} --format=csv"))
        assert [int(row[0]) for row in apps] == [pid3]
        gpus = csv_rows(sh(c, "node-02", f"nvidia-smi {scenarios.QUERY_GPU} --format=csv"))
        assert [row[4] for row in gpus] == ["0 %", "100 %"]


# --- scenario 3: Xid 79 --------------------------------------------------------------------------------------


def test_xid79_node_fails_nvidia_smi_and_logs_the_xid_with_the_rank_pid() -> None:
    scenario = scenarios.xid79()
    assert scenario.expected["gpus"] == ["node-02:0000:18:00.0"]
    with running(scenario) as c:
        check_nodes(c)
        r = c.ssh("node-02", f"nvidia-smi {scenarios.QUERY_GPU} --format=csv")
        assert r.returncode == 255
        assert r.stdout == "Unable to determine the device handle for GPU 0000:18:00.0: Unknown Error\n"
        assert c.ssh("node-02", "nvidia-smi").returncode == 255
        assert "NVIDIA H100" in sh(c, "node-01", f"nvidia-smi {scenarios.QUERY_GPU} --format=csv")
        kernel = sh(c, "node-02", "dmesg -T")
        xid = [line for line in kernel.splitlines() if "Xid" in line]
        assert len(xid) == 1
        # pid= is rank 2's pid as node-02 saw it (rank 2 is the one that died).
        assert xid[0].endswith(
            f"NVRM: Xid (PCI:0000:18:00): 79, pid={c.ns_pids[2]}, name=python, GPU has fallen off the bus."
        )
        assert "AER: Uncorrected (Fatal) error received: 0000:18:00.0" in kernel
        assert "Xid" not in sh(c, "node-01", "dmesg -T")
        raw = sh(c, "node-02", "dmesg")
        assert re.search(r"^\[712301\.118236\] NVRM: Xid", raw, re.M)


# --- scenario 4: a node whose sshd is down -------------------------------------------------------------------


def test_sshd_down_node_refuses_connections_while_its_ranks_run() -> None:
    scenario = scenarios.sshd_down()
    with running(scenario) as c:
        check_nodes(c, ["node-01", "node-02", "node-03"])
        r = c.ssh("node-04", "hostname")
        assert r.returncode == 255 and "Connection refused" in r.stderr
        assert c.alive() == {0: True, 1: True, 2: True, 3: True}
        inventory = yaml.safe_load(Path(c.inventory_file).read_text())
        assert inventory["jobs"] == {c.job_id: {"hosts": ["node-01", "node-02", "node-03", "node-04"]}}
        assert inventory["hosts"]["node-04"] == {
            "address": "127.0.0.14",
            "port": c.port,
            "user": "root",
            "key_file": c.key_file,
        }
        assert inventory["ssh"] == {"known_hosts": c.known_hosts, "key_file": c.key_file}
        assert scenario.expected["unreachable"] == ["node-04"]


# --- scenario 5: MTU mismatch ----------------------------------------------------------------------------------


def test_mtu_mismatch_node_reports_mtu_1500_on_the_fabric_port() -> None:
    scenario = scenarios.mtu_mismatch()
    with running(scenario) as c:
        assert c.hosts == ["node-01", "node-02", "node-03", "node-04"]
        check_nodes(c)
        for host in c.hosts:
            link = sh(c, host, "ip link")
            mtu = re.search(r"^4: ens3np0: <[^>]*> mtu (\d+) ", link, re.M).group(1)  # type: ignore[union-attr]
            assert mtu == ("1500" if host == "node-03" else "9000")
        # Anything but `ip link` is the real ip.
        assert "inet 127.0.0.1/8" in sh(c, "node-03", "ip addr show lo")
        assert scenario.expected["hosts"] == ["node-03"] and c.rank_host[2] == "node-03"


# --- scenario 6: zoo faults spread over nodes --------------------------------------------------------------------


def test_dataloader_hang_over_four_nodes() -> None:
    scenario = scenarios.dataloader_hang()
    with running(scenario) as c:
        check_nodes(c)
        assert c.rank_host == {0: "node-01", 1: "node-02", 2: "node-03", 3: "node-04"}
        for host in c.hosts:
            ranks, children = job_processes(c, host)
            assert len(ranks) == 1
            # Every rank has its DataLoader worker, on its own node.
            assert len(children) == 1
        assert c.ssh("node-02", "nvidia-smi").returncode == 127  # a plain node: no GPU tools
        assert "lo:" in sh(c, "node-02", "ip link")  # the real ip
        assert scenario.expected == {"category": "dataloader_stall", "ranks": [1], "hosts": ["node-02"]}


def test_rank_killed_over_two_nodes() -> None:
    scenario = scenarios.rank_killed()
    with running(scenario) as c:
        assert c.alive() == {0: True, 1: True, 2: False, 3: True}
        check_nodes(c)
        ranks, _ = job_processes(c, "node-02")
        assert ranks == {c.ns_pids[3]}
        # The killed rank's socket holder lives on in node-02, reparented to the node's PID 1.
        holders = [
            line for line in sh(c, "node-02", "ps -e -o ppid=,args=").splitlines() if "sleep infinity" in line
        ]
        assert [h.split()[0] for h in holders] == ["1"]
        assert "sleep infinity" not in sh(c, "node-01", "ps -e -o args=")
        assert scenario.expected == {"category": "rank_crashed", "ranks": [2], "hosts": ["node-02"]}


def test_known_hosts_pins_each_node_key() -> None:
    """StrictHostKeyChecking: node-02's key does not pass for node-01."""
    with running(scenarios.zoo_fault("skip_collective", 2, 2)) as c:
        lines = Path(c.known_hosts).read_text().splitlines()
        assert lines[0].startswith(f"[127.0.0.11]:{c.port},[node-01]:{c.port} ssh-ed25519 ")
        swapped = Path(c.known_hosts + ".swapped")
        swapped.write_text(lines[1].replace("127.0.0.12", "127.0.0.11").replace("node-02", "node-01") + "\n")
        argv = c.ssh_argv("node-01", "hostname")
        argv[argv.index(f"UserKnownHostsFile={c.known_hosts}")] = f"UserKnownHostsFile={swapped}"
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in r.stderr
