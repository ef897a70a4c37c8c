"""Multi-node hang scenarios for the simulated cluster: a zoo fault, a layout, what each node's tools print.

Each builder returns a Scenario (fault, nodes, ranks_per_node, node_specs, expected); `scenario.cluster()`
makes the Cluster. `expected` is what a correct diagnosis names:

    category     the root-cause category (CONTRACTS.md)
    ranks        culprit global ranks; for a host-wide fault (a link, an MTU) the job's ranks on that host
    hosts        culprit hosts
    gpus         "host:bus_id" (bus id as hangdx.probes.xid.normalize_bus_id writes it), when a GPU is named
    links        "host:ca/port" (an IB port) or "host:ifname" (an interface), when a link is named
    unreachable  hosts the probe cannot reach (and must say so)
    symptom      what the job itself shows when the root cause is hardware (the zoo fault's own verdict)

The recorded outputs all come from tests/fixtures (see the README in each fixture folder for where each
format comes from); only values change (which GPU is idle, which port is down, per-node ids and pids).
In the hardware scenarios the job's own fault is `rank_killed`: the rank behind the broken GPU or link is
gone (a CUDA error after Xid 79, NCCL aborting after IB transport errors) while the others wait.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from hangdx.zoo.launch import FAULTS

from .sim import FIXTURES, Cluster, NodeSpec, ToolOutput, node_address, node_name, quiet_kernel_log

SMI = FIXTURES / "nvidia_smi"
QUERY_GPU = "--query-gpu=index,uuid,pci.bus_id,name,utilization.gpu,memory.used,memory.total,power.draw"
QUERY_APPS = "--query-compute-apps=pid,process_name,gpu_uuid,gpu_bus_id,used_memory"
GPU_NAME = "NVIDIA H100 80GB HBM3"
MEM_TOTAL = 81559
# The rank processes as NVML names them: the interpreter the zoo job runs under.
PROCESS_NAME = sys.executable


class Scenario(NamedTuple):
    fault: str
    nodes: int
    ranks_per_node: int
    node_specs: dict[int, NodeSpec]
    expected: dict[str, Any]

    def cluster(self, **kwargs: Any) -> Cluster:
        return Cluster(self.nodes, self.ranks_per_node, self.fault, self.node_specs, **kwargs)


def _where(rank: int, ranks_per_node: int) -> tuple[int, int]:
    """(node index, local rank) of a global rank."""
    return rank // ranks_per_node, rank % ranks_per_node


def _ranks_on(node: int, ranks_per_node: int) -> list[int]:
    return list(range(node * ranks_per_node, (node + 1) * ranks_per_node))


def normalize_bus(bus: str) -> str:
    """`00000000:2A:00.0` -> `0000:2a:00.0` (how the parsers name a GPU)."""
    return bus[-12:].lower()


# --- nvidia-smi ---------------------------------------------------------------------------------------


@dataclass
class Gpu:
    index: int
    uuid: str
    bus_id: str  # as nvidia-smi prints it: 00000000:18:00.0
    util: int = 100
    mem_used: int = 74110
    power: float = 688.41
    temp: int = 44


def _fixture_gpus() -> list[tuple[str, str]]:
    """(uuid, bus id) of the 8 H100s in the recorded query-gpu CSV."""
    rows = (SMI / "query_gpu_8xh100_one_idle.csv").read_text().splitlines()[1:]
    return [(r.split(", ")[1], r.split(", ")[2]) for r in rows]


def node_gpus(node: int, count: int, idle: frozenset[int] = frozenset()) -> list[Gpu]:
    """GPUs 0..count-1 of a node (ids from the fixture, made unique per node); `idle` ones at 0 %."""
    gpus = []
    for i, (uuid, bus) in enumerate(_fixture_gpus()[:count]):
        uuid = uuid[:-4] + f"{node:02x}{i:02x}"  # every GPU's UUID is unique across the cluster
        if i in idle:
            gpus.append(Gpu(i, uuid, bus, util=0, mem_used=71210 + 16 * i, power=121.37 + i, temp=33))
        else:
            gpus.append(
                Gpu(i, uuid, bus, util=100, mem_used=74110 + 16 * i, power=688.41 + 1.13 * i, temp=44 + i % 3)
            )
    return gpus


def query_gpu_csv(gpus: list[Gpu]) -> str:
    """`nvidia-smi --query-gpu=index,uuid,pci.bus_id,name,utilization.gpu,memory.used,memory.total,power.draw --format=csv`."""
    out = [
        "index, uuid, pci.bus_id, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB], power.draw [W]"
    ]
    for g in gpus:
        out.append(
            f"{g.index}, {g.uuid}, {g.bus_id}, {GPU_NAME}, {g.util} %, {g.mem_used} MiB, {MEM_TOTAL} MiB, {g.power:.2f} W"
        )
    return "\n".join(out) + "\n"


def compute_apps_csv(gpus: list[Gpu], process_name: str = PROCESS_NAME) -> str:
    """`--query-compute-apps=pid,process_name,gpu_uuid,gpu_bus_id,used_memory --format=csv`: GPU i runs local rank i."""
    out = ["pid, process_name, gpu_uuid, gpu_bus_id, used_gpu_memory [MiB]"]
    for g in gpus:
        out.append(f"%PID{g.index}%, {process_name}, {g.uuid}, {g.bus_id}, {g.mem_used - 10} MiB")
    return "\n".join(out) + "\n"


_SEP = "+-----------------------------------------+----------------------+----------------------+"
_HEAD_535 = """\
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.161.08             Driver Version: 535.161.08   CUDA Version: 12.2     |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
|                                         |                      |               MIG M. |
|=========================================+======================+======================|
"""
_PROCS_535 = """\
+---------------------------------------------------------------------------------------+
| Processes:                                                                            |
|  GPU   GI   CI        PID   Type   Process name                            GPU Memory |
|        ID   ID                                                             Usage      |
|=======================================================================================|
"""


def smi_table_535(gpus: list[Gpu], when: float | None = None, process_name: str = PROCESS_NAME) -> str:
    """The default `nvidia-smi` table of driver 535 (89 columns), laid out like smi_535_h100_8gpu_one_idle.txt."""
    stamp = time.strftime("%a %b %e %H:%M:%S %Y", time.localtime(when if when is not None else time.time()))
    out = [stamp + "       ", *_HEAD_535.splitlines()]
    for g in gpus:
        left = f"{g.index:>4}  {GPU_NAME}"
        out.append(f"|{left}{'On  ':>{41 - len(left)}}| {g.bus_id} Off |{'0':>21} |")
        left = f" N/A   {g.temp:>2}C    P0"
        power = f"{int(g.power)}W / 700W "  # the table truncates the watts
        out.append(
            f"|{left}{power:>{41 - len(left)}}|{f'{g.mem_used}MiB / {MEM_TOTAL}MiB ':>22}|{f'{g.util}%':>8}{'Default':>13} |"
        )
        out.append(f"|{'':41}|{'':22}|{'Disabled':>21} |")
        out.append(_SEP)
    out.append(" " * 89)
    out += _PROCS_535.splitlines()
    if len(process_name) > 38:
        process_name = "..." + process_name[-35:]  # nvidia-smi cuts long names from the left
    for g in gpus:
        left = f"{g.index:>5}   N/A  N/A{f'%PID{g.index}%':>10}{'C':>7}   {process_name}"
        out.append(f"|{left}{f'{g.mem_used - 10}MiB ':>{87 - len(left)}}|")
    out.append("+" + "-" * 87 + "+")
    return "\n".join(out) + "\n"


def smi_outputs(gpus: list[Gpu]) -> dict[str, str | ToolOutput]:
    """What a node's nvidia-smi prints for the table and the collector's two queries."""
    return {
        "": smi_table_535(gpus),
        QUERY_GPU: query_gpu_csv(gpus),
        QUERY_APPS: compute_apps_csv(gpus),
    }


def smi_lost(bus_id: str) -> dict[str, str | ToolOutput]:
    """nvidia-smi on a node whose GPU fell off the bus: every call fails on that GPU's handle."""
    # Exit status 255: nvidia-smi's "other error or internal driver error".
    bus = bus_id[-12:].upper()
    return {
        "": ToolOutput(
            f"Unable to determine the device handle for GPU {bus}: Unknown Error\n", returncode=255
        )
    }


# --- InfiniBand ---------------------------------------------------------------------------------------

_IBSTAT = (FIXTURES / "ibstat" / "ibstat_10hca_mlx5_7_polling.txt").read_text()
_PORT_UP = "\t\tState: Active\n\t\tPhysical state: LinkUp\n\t\tRate: 400\n\t\tBase lid: {lid}\n\t\tLMC: 0\n\t\tSM lid: 1\n"
_PORT_DOWN = "\t\tState: Down\n\t\tPhysical state: Polling\n\t\tRate: 10\n\t\tBase lid: 65535\n\t\tLMC: 0\n\t\tSM lid: 0\n"
_LIDS = {
    "mlx5_0": 1201,
    "mlx5_1": 1202,
    "mlx5_2": 1203,
    "mlx5_3": 1204,
    "mlx5_6": 1205,
    "mlx5_7": 1206,
    "mlx5_8": 1207,
    "mlx5_9": 1208,
}
_PORT_STATE = re.compile(
    r"\t\tState: .*\n\t\tPhysical state: .*\n\t\tRate: .*\n\t\tBase lid: .*\n\t\tLMC: .*\n\t\tSM lid: .*\n"
)


def ibstat_text(node: int, down: str | None = None) -> str:
    """The recorded 10-HCA `ibstat`: every InfiniBand port Active except `down` (Down/Polling)."""
    blocks = re.split(r"(?m)^(?=CA ')", _IBSTAT)
    out = []
    for block in blocks:
        m = re.match(r"CA '([^']+)'", block)
        if m and m.group(1) in _LIDS:
            ca = m.group(1)
            state = _PORT_DOWN if ca == down else _PORT_UP.format(lid=_LIDS[ca] + 16 * node)
            block = _PORT_STATE.sub(lambda _m, s=state: s, block)
        out.append(block)
    # Node and port GUIDs are per adapter: make this node's differ from the recording's.
    return re.sub(
        r"0xa088c203([0-9a-f]{2})", lambda g: f"0xa088c2{node + 0x10:02x}{g.group(1)}", "".join(out)
    )


def _perfquery_blocks(ca: str) -> list[str]:
    """The recorded `perfquery -x` samples of one port (the marker lines hangdx adds taken off)."""
    text = (FIXTURES / "perfquery" / "perfquery_x_two_samples_rising.txt").read_text()
    marker = re.compile(r"(?m)^# hangdx sample \S+ ca=(\S+) port=\d+\n")
    found = list(marker.finditer(text))
    ends = [m.start() for m in found[1:]] + [len(text)]
    return [text[m.end() : end] for m, end in zip(found, ends, strict=True) if m.group(1) == ca]


def perfquery_samples(node: int, ca: str, failing: bool) -> list[str]:
    """Two `perfquery -x` samples of `ca` port 1: error counters rising when `failing`, else quiet."""
    samples = _perfquery_blocks("mlx5_7" if failing else "mlx5_0")
    lid = _LIDS[ca] + 16 * node
    return [re.sub(r"Lid \d+ port", f"Lid {lid} port", s) for s in samples]


def perfquery_ports(node: int, bad_port: str | None = None) -> dict[str, list[str]]:
    """Samples for every InfiniBand port of the recorded ibstat (its Ethernet ports answer no MADs)."""
    return {f"{ca}:1": perfquery_samples(node, ca, failing=ca == bad_port) for ca in _LIDS}


# Where the recorded kernel log puts the first HCAs.
_HCA_PCI = {"mlx5_0": "0000:0c:00.0", "mlx5_1": "0000:2a:00.0"}


def ib_flap_kernel_log(ca: str, pci: str) -> str:
    """Boot messages, then `ca` port 1 going down, coming back, and going down again (raw dmesg)."""
    return quiet_kernel_log() + (
        f"[712288.504113] mlx5_core {pci} {ca}: Port: 1 Link DOWN\n"
        f"[712290.771958] mlx5_core {pci} {ca}: Port: 1 Link INIT\n"
        f"[712291.020334] mlx5_core {pci} {ca}: Port: 1 Link ACTIVE\n"
        f"[712297.338071] mlx5_core {pci} {ca}: Port: 1 Link DOWN\n"
    )


_IB_HCAS = "[0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB [4]mlx5_6:1/IB [5]mlx5_7:1/IB [6]mlx5_8:1/IB [7]mlx5_9:1/IB"


def nccl_log(
    node: int, local: int, rank: int, nodes: int, ranks_per_node: int, ib_error: dict | None = None
) -> str:
    """A NCCL 2.29 INFO log of one rank (init, a few all_reduces), in the line formats of ib_status_2.29.log.

    `ib_error` = {"ca": ..., "peer": address}: the rank's proxy thread then reports a transport retry
    error from that peer on that HCA and the port's async error event (with NCCL's WARN timestamps).
    `%HOST%` and `%PID<n>%` are filled in by the node when the rank starts.
    """
    nranks = nodes * ranks_per_node
    me = f"%HOST%:%PID{local}%"
    main_t, proxy_t, async_t = f"{me}:%PID{local}%", f"{me}:%PID{local}+91%", f"{me}:%PID{local}+87%"
    dev = f"[{local}]"
    comm = "0x561dde2fb110"
    addr = node_address(node)
    lines = [
        f"{main_t} {dev} NCCL INFO Bootstrap: Using eno1:{addr}<0>",
        f"{main_t} {dev} NCCL INFO cudaDriverVersion 12080",
        f"{main_t} {dev} NCCL INFO NCCL version 2.29.2+cuda12.8",
        f"{proxy_t} {dev} NCCL INFO NET/IB : Using {_IB_HCAS} ; OOB eno1:{addr}<0>",
        f"{proxy_t} {dev} NCCL INFO Using network IB",
        f"{main_t} {dev} NCCL INFO comm {comm} rank {rank} nRanks {nranks} nNodes {nodes} localRanks {ranks_per_node} localRank {local} MNNVL 0",
        f"{main_t} {dev} NCCL INFO ncclCommInitRankConfig comm {comm} rank {rank} nranks {nranks} cudaDev {local} "
        f"nvmlDev {local} busId {_fixture_gpus()[local][1][9:11].lower()}000 commId 0x5ae77eb5ea4ec1ee - Init COMPLETE",
    ]
    for op in range(4):
        lines.append(
            f"{main_t} {dev} NCCL INFO AllReduce: opCount {op:x} sendbuff 0x7f50e6f3c000 recvbuff 0x7f50e6f3c000 "
            f"count 4194304 datatype 9 op 0 root 0 comm {comm} [nranks={nranks}] stream 0x55f1de7279a0"
        )
    if ib_error:
        stamp = time.strftime("[%Y-%m-%d %H:%M:%S]", time.localtime())
        ca, peer = ib_error["ca"], ib_error["peer"]
        lines += [
            f"{stamp} {proxy_t} {dev} transport/net_ib/p2p.cc:550 NCCL WARN NET/IB: Got completion from peer "
            f"{peer}<52311> with status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_RECV(128) vendor_err=129  hca {ca}",
            f"{proxy_t} {dev} NCCL INFO transport/net.cc:1362 -> 6",
            f"{proxy_t} {dev} NCCL INFO proxy.cc:910 -> 6 [Progress Thread]",
            f"{stamp} {async_t} {dev} transport/net_ib/common.cc:88 NCCL WARN NET/IB : {ca}:1 Got non-fatal async "
            "event: port error(10)",
        ]
    return "\n".join(lines) + "\n"


# --- ip link ------------------------------------------------------------------------------------------

_IP_LINK = (FIXTURES / "ip_link" / "ip_link_gpu_node.txt").read_text()


def ip_link_text(node: int, mtu: dict[str, int] | None = None) -> str:
    """The recorded GPU node's `ip link`: RoCE ports ens3np0/ens4np0 at MTU 9000 (or `mtu`), IPoIB all up."""
    mtus = {"ens3np0": 9000, "ens4np0": 9000, **(mtu or {})}
    out = []
    for line in _IP_LINK.splitlines():
        m = re.match(r"^\d+: ([^:@]+)", line)
        if m and m.group(1) in mtus:
            line = re.sub(r"mtu \d+", f"mtu {mtus[m.group(1)]}", line)
        if m and m.group(1) == "ibp204s0":
            line = line.replace("<NO-CARRIER,BROADCAST,MULTICAST,UP>", "<BROADCAST,MULTICAST,UP,LOWER_UP>")
            line = line.replace("state DOWN", "state UP")
        out.append(line)
    text = "\n".join(out) + "\n"
    # MAC addresses (and the GUIDs inside IPoIB addresses) are per adapter: change one byte per node.
    text = re.sub(
        r"(link/ether [0-9a-f]{2}:[0-9a-f]{2}:)([0-9a-f]{2})",
        lambda g: g.group(1) + f"{node + 0x10:02x}",
        text,
    )
    return text.replace("a0:88:c2:03:", f"a0:88:c2:{node + 0x10:02x}:")


# --- nodes and scenarios --------------------------------------------------------------------------------


def gpu_node(
    node: int,
    gpus: int,
    idle: frozenset[int] = frozenset(),
    *,
    bad_port: str | None = None,
    mtu: dict[str, int] | None = None,
) -> NodeSpec:
    """A healthy GPU node (GPUs busy, IB ports active, counters quiet, MTU 9000) but for what is asked."""
    return NodeSpec(
        nvidia_smi=smi_outputs(node_gpus(node, gpus, idle)),
        ibstat=ibstat_text(node, down=bad_port),
        perfquery=perfquery_ports(node, bad_port),
        dmesg=ib_flap_kernel_log(bad_port, _HCA_PCI.get(bad_port, "0000:0c:00.0"))
        if bad_port
        else quiet_kernel_log(),
        ip_link=ip_link_text(node, mtu),
    )


def gpu_idle(nodes: int = 2, ranks_per_node: int = 2) -> Scenario:
    """skip_collective: every GPU spins at 100 % in the collective but rank 1's, at 0 % (it is elsewhere)."""
    culprit = FAULTS["skip_collective"].culprit_ranks[0]
    bad_node, bad_local = _where(culprit, ranks_per_node)
    specs = {
        i: gpu_node(i, ranks_per_node, frozenset({bad_local}) if i == bad_node else frozenset())
        for i in range(nodes)
    }
    gpu = node_gpus(bad_node, ranks_per_node)[bad_local]
    host = node_name(bad_node)
    return Scenario(
        "skip_collective",
        nodes,
        ranks_per_node,
        specs,
        {
            "category": "conditional_collective",
            "ranks": [culprit],
            "hosts": [host],
            "gpus": [f"{host}:{normalize_bus(gpu.bus_id)}"],
        },
    )


def ib_link_flap(
    nodes: int = 2, ranks_per_node: int = 2, fault: str = "rank_killed", rank: int = 2
) -> Scenario:
    """A loose IB cable on `rank`'s node: its HCA's port flaps and is down, error counters rise, NCCL errors."""
    bad_node, bad_local = _where(rank, ranks_per_node)
    ca = "mlx5_0" if bad_local == 0 else f"mlx5_{bad_local}"
    peer = node_address((bad_node + 1) % nodes)
    specs = {}
    for i in range(nodes):
        spec = gpu_node(i, ranks_per_node, bad_port=ca if i == bad_node else None)
        if i == bad_node:
            spec.nvidia_smi = smi_outputs(node_gpus(i, ranks_per_node, frozenset({bad_local})))
        spec.nccl_logs = {
            local: nccl_log(
                i,
                local,
                i * ranks_per_node + local,
                nodes,
                ranks_per_node,
                {"ca": ca, "peer": peer} if i == bad_node else None,
            )
            for local in range(ranks_per_node)
        }
        specs[i] = spec
    host = node_name(bad_node)
    return Scenario(
        fault,
        nodes,
        ranks_per_node,
        specs,
        {
            "category": "network_fault",
            "ranks": _ranks_on(bad_node, ranks_per_node),
            "hosts": [host],
            "links": [f"{host}:{ca}/1"],
            "symptom": _symptom(fault),
        },
    )


def xid79(nodes: int = 2, ranks_per_node: int = 2, fault: str = "rank_killed", rank: int = 2) -> Scenario:
    """The GPU of `rank` falls off the bus: Xid 79 in its node's kernel log, nvidia-smi fails there."""
    bad_node, bad_local = _where(rank, ranks_per_node)
    specs = {i: gpu_node(i, ranks_per_node) for i in range(nodes)}
    gpu = node_gpus(bad_node, ranks_per_node)[bad_local]
    bus = normalize_bus(gpu.bus_id)  # 0000:18:00.0
    fixture = (FIXTURES / "kernel_log" / "dmesg_xid79.txt").read_text().splitlines()
    # The recording's GPU is 0000:3b:00.0 under root port 0000:3a:00.0; the hung-task report that follows
    # in it is about another node's ranks and is left out.
    cut = next(i for i, line in enumerate(fixture) if "INFO: task" in line)
    dev_bus = bus[5:7]
    root_bus = f"{int(dev_bus, 16) - 1:02x}"
    text = "\n".join(fixture[:cut]) + "\n"
    text = text.replace("3b:00", f"{dev_bus}:00").replace("3a:00.0", f"{root_bus}:00.0")
    text = text.replace("pid=48213", f"pid=%PID{bad_local}%").replace(
        "GPU-8f1e2c4a-6b7d-4e2f-9a31-5c0d7e8b9f12", gpu.uuid
    )
    specs[bad_node].dmesg = text
    specs[bad_node].nvidia_smi = smi_lost(gpu.bus_id)
    host = node_name(bad_node)
    return Scenario(
        fault,
        nodes,
        ranks_per_node,
        specs,
        {
            "category": "gpu_fault",
            "ranks": [rank],
            "hosts": [host],
            "gpus": [f"{host}:{bus}"],
            "xid": 79,
            "symptom": _symptom(fault),
        },
    )


def sshd_down(
    nodes: int = 4, ranks_per_node: int = 1, fault: str = "skip_collective", down: int = 3
) -> Scenario:
    """Node `down` (0-based) cannot be reached (its sshd is down; its ranks run): the rest is still diagnosed.

    Four one-rank nodes: with one node unseen, three ranks remain, enough to tell the odd one out.
    """
    specs = {down: NodeSpec(sshd=False)}
    f = FAULTS[fault]
    expected = _zoo_expected(fault, ranks_per_node)
    expected["unreachable"] = [node_name(down)]
    if any(_where(r, ranks_per_node)[0] == down for r in f.culprit_ranks):
        raise ValueError("put the culprit on a reachable node (or expect nothing about it)")
    return Scenario(fault, nodes, ranks_per_node, specs, expected)


def mtu_mismatch(
    nodes: int = 4, ranks_per_node: int = 1, fault: str = "rank_killed", rank: int = 2
) -> Scenario:
    """`rank`'s node has MTU 1500 on RoCE port ens3np0, where every other node has 9000."""
    bad_node, _ = _where(rank, ranks_per_node)
    specs = {
        i: gpu_node(i, ranks_per_node, mtu={"ens3np0": 1500} if i == bad_node else None) for i in range(nodes)
    }
    host = node_name(bad_node)
    return Scenario(
        fault,
        nodes,
        ranks_per_node,
        specs,
        {
            "category": "network_fault",
            "ranks": _ranks_on(bad_node, ranks_per_node),
            "hosts": [host],
            "links": [f"{host}:ens3np0"],
            "symptom": _symptom(fault),
        },
    )


def zoo_fault(fault: str, nodes: int, ranks_per_node: int) -> Scenario:
    """A zoo fault spread over plain nodes (no GPU tools; quiet kernel log; the real `ip link`)."""
    return Scenario(fault, nodes, ranks_per_node, {}, _zoo_expected(fault, ranks_per_node))


def dataloader_hang() -> Scenario:
    """dataloader_hang on 4 nodes x 1 rank: rank 1 (node-02) waits on its DataLoader worker."""
    return zoo_fault("dataloader_hang", 4, 1)


def rank_killed() -> Scenario:
    """rank_killed on 2 nodes x 2 ranks: rank 2 (node-02) is SIGKILLed, the others wait in all_reduce."""
    return zoo_fault("rank_killed", 2, 2)


def ras_rank_killed() -> Scenario:
    """rank_killed on 2 nodes x 2 ranks, with NCCL RAS on both nodes: `ncclras` reports rank 2 (node-02) dead.

    The report is what NCCL 2.29.7 prints for it (tests/fixtures/ncclras/generate.py, from NCCL's format
    strings); the RAS addresses are the nodes' addresses, its pids made up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ncclras_generate", FIXTURES / "ncclras" / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    nodes, per = 2, 2
    report = gen.cluster_dead(
        [node_address(i) for i in range(nodes)], per, 2, {r: 51200 + r for r in range(nodes * per)}
    )
    expected = {**_zoo_expected("rank_killed", per), "gpus": ["node-02:GPU 0"]}
    return Scenario("rank_killed", nodes, per, {i: NodeSpec(ncclras=report) for i in range(nodes)}, expected)


def _zoo_expected(fault: str, ranks_per_node: int) -> dict[str, Any]:
    f = FAULTS[fault]
    ranks = sorted(f.culprit_ranks)
    return {
        "category": f.category,
        "ranks": ranks,
        "hosts": sorted({node_name(_where(r, ranks_per_node)[0]) for r in ranks}),
    }


def _symptom(fault: str) -> dict[str, Any]:
    f = FAULTS[fault]
    return {"category": f.category, "ranks": sorted(f.culprit_ranks)}


SCENARIOS = {
    "gpu_idle": gpu_idle,
    "ib_link_flap": ib_link_flap,
    "xid79": xid79,
    "sshd_down": sshd_down,
    "mtu_mismatch": mtu_mismatch,
    "dataloader_hang": dataloader_hang,
    "rank_killed": rank_killed,
    "ras_rank_killed": ras_rank_killed,
}
