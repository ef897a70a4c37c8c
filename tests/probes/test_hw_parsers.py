"""Hardware and host artifacts: nvidia-smi, kernel logs, ibstat/ibstatus, perfquery, ip link.

This machine has no GPU and no InfiniBand, so the fixtures under tests/fixtures/{nvidia_smi,
kernel_log,ibstat,perfquery,ip_link}/ are written in the exact layout the real tools print,
taken from real output quoted in public issues, docs and driver sources; each folder's
README.md names where every format comes from. `ip` output was also checked against
iproute2 on this machine, and `dmesg -T`/`--time-format iso` against util-linux here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdx.probes import ibstat, ip_link, kernel_log, nvidia_smi, perfquery
from hangdx.probes.model import Evidence, Source
from hangdx.probes.registry import detect, parse_artifact
from hangdx.probes.xid import XID_TABLE, describe, likely_cause, normalize_bus_id

FIX = Path(__file__).resolve().parent.parent / "fixtures"
MODULES = {m.KIND: m for m in (nvidia_smi, kernel_log, ibstat, perfquery, ip_link)}


def fixture(kind: str, name: str) -> bytes:
    return (FIX / kind / name).read_bytes()


def read(kind: str, name: str, host: str | None = "gpu-node-03", ev: Evidence | None = None) -> Evidence:
    ev = ev if ev is not None else Evidence()
    MODULES[kind].parse(fixture(kind, name), Source(f"{host}/{name}", host=host), ev)
    return ev


def all_fixtures() -> list[tuple[str, str]]:
    return [
        (kind, p.name)
        for kind in MODULES
        for p in sorted((FIX / kind).iterdir())
        if p.is_file() and p.name != "README.md"
    ]


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize(("kind", "name"), all_fixtures())
def test_detected_by_content_and_not_claimed_by_the_others(kind: str, name: str) -> None:
    data = fixture(kind, name)
    mod = detect(data)
    assert mod is not None and mod.KIND == kind
    for other, m in MODULES.items():
        if other != kind:
            assert m.sniff(data[:65536]) == 0, f"{other} claims {kind}/{name}"


def test_parse_artifact_reads_a_fixture_without_being_told_the_kind() -> None:
    ev = Evidence()
    src = Source("gpu-node-03/dmesg.txt", host="gpu-node-03")
    assert parse_artifact(fixture("kernel_log", "dmesg_xid79.txt"), src, ev) == "kernel_log"
    assert [e.fields["xid"] for e in ev.events_of("xid")] == [79]


def test_a_few_pasted_kernel_lines_do_not_make_a_stderr_a_kernel_log() -> None:
    stderr = (
        b"Traceback (most recent call last):\n"
        b'  File "train.py", line 12, in <module>\n'
        b"RuntimeError: CUDA error: unspecified launch failure\n"
        b"[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics Exception\n"
    ) + b"step 10 loss 1.0\n" * 40
    assert kernel_log.sniff(stderr) < 50
    assert nvidia_smi.sniff(stderr) == 0


# ---------------------------------------------------------------- nvidia-smi


def test_smi_535_table_one_idle_gpu_among_eight() -> None:
    ev = read("nvidia_smi", "smi_535_h100_8gpu_one_idle.txt")
    assert [g.index for g in ev.gpus] == list(range(8))
    idle = [g for g in ev.gpus if g.util_pct == 0]
    assert [g.index for g in idle] == [3]
    assert all(g.util_pct == 100 for g in ev.gpus if g.index != 3)
    g3 = ev.gpus[3]
    assert g3.bus_id == "0000:5d:00.0"
    assert g3.name == "NVIDIA H100 80GB HBM3"
    assert (g3.mem_used_mib, g3.mem_total_mib, g3.power_w) == (71210, 81559, 121)
    assert g3.pids == [2214874]
    assert g3.host == "gpu-node-03"
    assert g3.quote is not None and "00000000:5D:00.0" in g3.quote.text and g3.quote.line == 21
    assert not ev.events


def test_smi_570_table_maps_processes_to_gpus() -> None:
    ev = read("nvidia_smi", "smi_570_h100_8gpu.txt")
    assert len(ev.gpus) == 8
    by_index = {g.index: g for g in ev.gpus}
    assert by_index[5].pids == [3373465, 3391022]
    assert by_index[0].pids == [3373460]
    assert by_index[7].bus_id == "0000:db:00.0"
    assert by_index[0].power_w == 640 and by_index[0].mem_used_mib == 70021


def test_smi_470_table_err_gives_gpu_error() -> None:
    ev = read("nvidia_smi", "smi_470_a100_4gpu_err.txt")
    assert [g.name for g in ev.gpus] == ["NVIDIA A100-SXM..."] * 4
    assert ev.gpus[2].power_w is None and ev.gpus[1].power_w == 302
    (err,) = ev.events_of("gpu_error")
    assert err.fields["index"] == 2 and err.fields["bus_id"] == "0000:47:00.0"
    assert err.fields["columns"] == ["power"]
    assert "ERR!" in err.quote.text
    assert [g.pids for g in ev.gpus] == [[51807], [51808], [51809], [51810]]


@pytest.mark.parametrize(
    "name", ["query_gpu_8xh100_one_idle.csv", "query_gpu_nounits.csv", "query_gpu_noheader_nounits.csv"]
)
def test_smi_query_gpu_csv(name: str) -> None:
    ev = read("nvidia_smi", name)
    assert len(ev.gpus) == 8
    g = ev.gpus[3]
    assert g.index == 3 and g.util_pct == 0
    assert g.uuid == "GPU-36f675cc-81e7-4ef5-e8e2-5d940ed90475"
    assert g.bus_id == "0000:5d:00.0"
    assert (g.mem_used_mib, g.mem_total_mib, g.power_w) == (71210, 81559, 121.37)
    assert [x.util_pct for x in ev.gpus].count(100) == 7
    assert not ev.gaps


def test_smi_compute_apps_alone_become_gpu_process_events() -> None:
    ev = read("nvidia_smi", "compute_apps.csv")
    procs = ev.events_of("gpu_process")
    assert len(procs) == 8
    p = procs[3]
    assert p.pid == 2214874
    assert p.fields == {
        "pid": 2214874,
        "process_name": "/usr/bin/python3",
        "gpu_uuid": "GPU-36f675cc-81e7-4ef5-e8e2-5d940ed90475",
        "gpu_bus_id": "0000:5d:00.0",
        "used_memory_mib": 71200,
    }


def test_smi_compute_apps_join_the_gpu_table_in_either_order() -> None:
    first = read("nvidia_smi", "query_gpu_8xh100_one_idle.csv")
    read("nvidia_smi", "compute_apps.csv", ev=first)
    assert first.gpus[3].pids == [2214874]
    assert not first.events_of("gpu_process")  # joined, nothing left to join later

    later = read("nvidia_smi", "compute_apps.csv")
    read("nvidia_smi", "query_gpu_8xh100_one_idle.csv", ev=later)
    assert [g.pids for g in later.gpus] == [[2214871 + i] for i in range(8)]


def test_smi_compute_apps_of_another_host_do_not_join() -> None:
    ev = read("nvidia_smi", "compute_apps.csv", host="gpu-node-04")
    read("nvidia_smi", "query_gpu_8xh100_one_idle.csv", host="gpu-node-03", ev=ev)
    assert all(g.pids == [] for g in ev.gpus)


def test_smi_compute_apps_headerless() -> None:
    ev = read("nvidia_smi", "compute_apps_noheader_nounits.csv")
    assert [(e.pid, e.fields["gpu_bus_id"], e.fields["used_memory_mib"]) for e in ev.events] == [
        (2214871, "0000:18:00.0", 74100),
        (2214872, "0000:2a:00.0", 74116),
    ]


def test_smi_headerless_csv_of_unknown_shape_is_skipped_with_a_gap() -> None:
    ev = Evidence()
    nvidia_smi.parse(b"81559, 71210, 100\n81559, 74110, 100\n", Source("x.csv"), ev)
    assert not ev.gpus and not ev.events
    assert ev.gaps and "without a header" in ev.gaps[0].message


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("failed_driver.txt", "it couldn't communicate with the NVIDIA driver."),
        ("no_devices.txt", "No devices were found"),
        ("nvml_mismatch.txt", "Driver/library version mismatch"),
    ],
)
def test_smi_failures(name: str, reason: str) -> None:
    ev = read("nvidia_smi", name)
    (e,) = ev.events_of("nvidia_smi_failed")
    assert e.fields["reason"].startswith(reason)
    assert e.host == "gpu-node-03" and e.quote.line == 1
    assert not ev.gpus


def test_smi_gpu_lost_unknown_error() -> None:
    (e,) = read("nvidia_smi", "gpu_lost_unknown_error.txt").events
    assert e.kind == "gpu_lost"
    assert e.fields == {"bus_id": "0000:3b:00.0", "reason": "Unknown Error"}


def test_smi_one_gpu_lost_among_csv_rows() -> None:
    ev = read("nvidia_smi", "query_gpu_one_lost.csv")
    (lost,) = ev.events_of("gpu_lost")
    assert lost.fields["bus_id"] == "0000:5d:00.0" and lost.fields["gpu_index"] == 3
    assert "GPU is lost" in lost.fields["reason"]
    assert [g.index for g in ev.gpus] == [0, 1, 2, 4, 5, 6, 7]


def test_smi_csv_unknown_error_values() -> None:
    ev = read("nvidia_smi", "query_gpu_unknown_error.csv")
    (e,) = ev.events_of("gpu_error")
    assert e.fields["index"] == 2
    assert e.fields["columns"] == ["util_pct", "mem_used_mib", "power_w"]
    g2 = ev.gpus[2]
    assert (g2.util_pct, g2.mem_used_mib, g2.mem_total_mib) == (None, None, 81559)


# ---------------------------------------------------------------- kernel log


def test_xid_table_covers_the_common_codes() -> None:
    for code in (13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120):
        meaning, action, severity = XID_TABLE[code]
        assert meaning and action and severity in ("critical", "error", "warning", "info")
    assert "fallen off the bus" in XID_TABLE[79][0] and "reseat" in XID_TABLE[79][1]
    assert XID_TABLE[48][2] == "critical" and "RMA" in XID_TABLE[48][1]
    assert {likely_cause(c) for c in (13, 31, 43)} == {"application"}
    assert likely_cause(119) == likely_cause(120) == "driver"
    assert describe(999)[0].startswith("Xid 999")


def test_normalize_bus_id() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("PCI:0000:3b:00") == "0000:3b:00.0"
    assert normalize_bus_id("3b:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("not a bus") is None


def test_dmesg_xid79_node() -> None:
    ev = read("kernel_log", "dmesg_xid79.txt")
    (x,) = ev.events_of("xid")  # the bare "fallen off the bus" line stands in for nothing here
    assert x.fields["xid"] == 79 and x.fields["bus_id"] == "0000:3b:00.0"
    assert x.pid == 48213 and x.fields["pid"] == 48213 and x.fields["process"] == "python"
    assert x.fields["gpu_uuid"] == "GPU-8f1e2c4a-6b7d-4e2f-9a31-5c0d7e8b9f12"
    assert x.fields["severity"] == "critical" and x.fields["cause"] == "hardware"
    assert "Drain" in x.fields["action"]
    assert x.fields["uptime"] == 712301.118236
    assert x.host == "gpu-node-03"  # a bare dmesg says nothing of its host
    assert x.quote.line == 8 and x.quote.text.endswith("GPU has fallen off the bus.")
    (aer,) = ev.events_of("pcie_error")
    assert aer.fields["bus_id"] == "0000:3b:00.0" and aer.fields["severity"] == "fatal"
    assert aer.fields["type"] == "Inaccessible"
    (hung,) = ev.events_of("hung_task")
    assert (hung.fields["comm"], hung.pid, hung.fields["seconds"]) == ("python", 48215, 245)
    assert [e.fields["device"] for e in ev.events_of("nic_link")] == ["mlx5_0", "mlx5_1"]


def test_dmesg_T_ecc_oom_segfault() -> None:
    ev = read("kernel_log", "dmesg_T_ecc_oom.txt", host=None)
    xids = ev.events_of("xid")
    assert [(e.fields["xid"], e.pid) for e in xids] == [(94, 20211), (63, 20211), (48, None), (45, 20219)]
    assert xids[2].fields["bus_id"] == "0000:cb:00.0" and "process" not in xids[2].fields
    assert xids[0].fields["time_text"] == "Sun Nov 22 00:41:07 2026"
    assert xids[1].fields["severity"] == "info" and xids[0].fields["severity"] == "error"
    (oom,) = ev.events_of("oom_kill")  # the oom-kill: line and the Killed process line are one kill
    assert oom.pid == 20214 and oom.fields["comm"] == "python3"
    assert oom.fields["constraint"] == "CONSTRAINT_MEMCG"
    assert oom.fields["anon_rss_kb"] == 198127604
    segv = ev.events_of("segfault")
    assert [(e.fields["comm"], e.pid, e.fields["signal"]) for e in segv] == [
        ("pt_data_worker", 20377, "segfault"),
        ("python3", 20230, "general protection fault"),
    ]
    assert segv[0].fields["library"] == "libc.so.6"
    (aer,) = ev.events_of("pcie_error")
    assert aer.fields["severity"] == "corrected" and aer.fields["bus_id"] == "0000:01:00.0"
    assert all(e.host is None for e in ev.events)


def test_journalctl_k_names_the_host_and_reads_links_nfs_and_app_faults() -> None:
    ev = read("kernel_log", "journalctl_k_gpu-node-03.txt", host=None)
    assert {e.host for e in ev.events} == {"gpu-node-03"}
    assert ev.hosts == ["gpu-node-03"]
    links = [(e.fields["device"], e.fields["state"]) for e in ev.events_of("nic_link")]
    assert links == [
        ("0000:0c:00.0", "down"),
        ("mlx5_0", "down"),
        ("ens3np0", "down"),
        ("0000:0c:00.0", "up"),
        ("mlx5_0", "init"),
        ("mlx5_0", "up"),
        ("eno1", "down"),
        ("eno1", "up"),
    ]
    assert ev.events_of("nic_link")[0].fields["cable"] == "unplugged"
    assert ev.events_of("nic_link")[1].fields["port"] == 1
    nfs = ev.events_of("nfs_not_responding")
    assert [(e.fields["server"], e.fields["how"]) for e in nfs] == [
        ("nfs01", "still trying"),
        ("nfs01", "timed out"),
    ]
    assert [e.fields["server"] for e in ev.events_of("nfs_ok")] == ["nfs01"]
    causes = {e.fields["xid"]: e.fields["cause"] for e in ev.events_of("xid")}
    assert causes == {13: "application", 43: "application", 31: "application", 119: "driver"}
    gsp = ev.events_of("xid")[-1]
    assert gsp.fields["severity"] == "critical" and gsp.pid == 91830
    assert gsp.fields["time_text"] == "Nov 22 01:12:02"
    (hung,) = ev.events_of("hung_task")
    assert hung.pid == 91825


def test_fallen_off_the_bus_without_an_xid_line_counts_as_xid_79() -> None:
    # Newer drivers print this multi-line message (NVIDIA/NVSentinel#155) without an Xid line
    data = (
        b"[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
        b"               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        b"               NVRM: fallen off the bus and is not responding to commands.\n"
        b"[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).\n"
    )
    ev = Evidence()
    kernel_log.parse(data, Source("dmesg", host="gpu-node-07"), ev)
    (x,) = ev.events_of("xid")
    assert x.fields["xid"] == 79 and x.fields["bus_id"] == "0000:b3:00.0" and x.fields["inferred"] is True
    assert x.quote.line == 3


def test_iso_prefixes() -> None:
    data = (
        b"2026-11-22T01:02:03,118236+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid=48213, name=python, "
        b"GPU has fallen off the bus.\n"
        b"2026-11-22T01:02:09+0000 gpu-node-09 kernel: nfs: server nfs01 not responding, still trying\n"
    )
    assert kernel_log.sniff(data) > 0
    ev = Evidence()
    kernel_log.parse(data, Source("k.log", host="fallback"), ev)
    x, nfs = ev.events
    assert x.kind == "xid" and x.host == "fallback" and x.fields["time"] == 1795309323.118236
    assert (
        nfs.kind == "nfs_not_responding" and nfs.host == "gpu-node-09" and nfs.fields["time"] == 1795309329.0
    )


def test_dmesg_x_facility_prefix() -> None:
    data = b"kern  :err   : [712301.118236] NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=python, DBE\n"
    ev = Evidence()
    kernel_log.parse(data, Source("d"), ev)
    assert ev.events[0].fields["xid"] == 48 and ev.events[0].fields["uptime"] == 712301.118236


# ---------------------------------------------------------------- ibstat


def test_ibstat_one_port_polling() -> None:
    ev = read("ibstat", "ibstat_10hca_mlx5_7_polling.txt")
    assert len(ev.ib_ports) == 10
    bad = [p for p in ev.ib_ports if p.state != "Active"]
    assert [(p.ca, p.port, p.state, p.phys_state, p.rate) for p in bad] == [
        ("mlx5_7", 1, "Down", "Polling", "10")
    ]
    assert bad[0].quote is not None and bad[0].quote.text.strip() == "Physical state: Polling"
    assert bad[0].host == "gpu-node-03" and bad[0].link_layer == "InfiniBand"
    assert {p.ca for p in ev.ib_ports if p.link_layer == "Ethernet"} == {"mlx5_4", "mlx5_5"}
    assert all(p.rate == "400" for p in ev.ib_ports if p.link_layer == "InfiniBand" and p.state == "Active")


def test_ibstatus_in_ibstat_words() -> None:
    ev = read("ibstat", "ibstatus_one_down.txt")
    got = [(p.ca, p.port, p.state, p.phys_state, p.rate, p.link_layer) for p in ev.ib_ports]
    assert got == [
        ("mlx5_0", 1, "Active", "LinkUp", "400", "InfiniBand"),
        ("mlx5_1", 1, "Down", "Polling", "10", "InfiniBand"),
        ("mlx5_2", 1, "Initializing", "LinkUp", "400", "InfiniBand"),
    ]
    assert "2: Polling" in ev.ib_ports[1].quote.text


def test_ibstat_ibpanic_becomes_a_gap() -> None:
    # ibstat stops at a CA it cannot read (leptonai/gpud#752)
    data = fixture("ibstat", "ibstat_10hca_mlx5_7_polling.txt").split(b"CA 'mlx5_8'")[0]
    data += b"ibpanic: [1323906] main: stat of IB device 'mlx5_8' failed: No such file or directory\n"
    ev = Evidence()
    ibstat.parse(data, Source("ibstat.txt"), ev)
    assert len(ev.ib_ports) == 8
    assert "mlx5_8" in ev.gaps[0].message


# ---------------------------------------------------------------- perfquery


def test_perfquery_two_samples_with_markers_show_rising_errors() -> None:
    ev = read("perfquery", "perfquery_x_two_samples_rising.txt")
    assert [(p.ca, p.port) for p in ev.ib_ports] == [("mlx5_0", 1), ("mlx5_7", 1)] * 2
    bad = sorted((p for p in ev.ib_ports if p.ca == "mlx5_7"), key=lambda p: p.sampled_at or 0)
    assert bad[0].sampled_at == 1795830893.433 and bad[1].sampled_at == 1795830895.437
    for name, before, after in [
        ("SymbolErrorCounter", 1204, 1587),
        ("LinkErrorRecoveryCounter", 3, 5),
        ("PortRcvErrors", 211, 298),
        ("PortXmitDiscards", 17, 26),
    ]:
        assert (bad[0].counters[name], bad[1].counters[name]) == (before, after)
    assert bad[1].counters["LinkDownedCounter"] == bad[0].counters["LinkDownedCounter"] == 1
    assert bad[0].counters["PortXmitData"] == 904417718890
    assert "PortSelect" not in bad[0].counters and "CounterSelect2" not in bad[0].counters
    assert len(bad[0].counters) == 22
    good = [p for p in ev.ib_ports if p.ca == "mlx5_0"]
    assert all(p.counters["SymbolErrorCounter"] == 0 for p in good)
    assert bad[0].quote is not None and bad[0].quote.text.startswith(
        "# Port extended counters: Lid 1208 port 1"
    )


def test_perfquery_without_markers_orders_samples_by_position() -> None:
    ev = read("perfquery", "perfquery_plain_same_port_twice.txt")
    assert [(p.ca, p.port, p.sampled_at) for p in ev.ib_ports] == [("lid1208", 1, 0.0), ("lid1208", 1, 1.0)]
    assert [p.counters["SymbolErrorCounter"] for p in ev.ib_ports] == [1204, 1587]
    assert ev.ib_ports[0].counters["PortXmitData"] == 4294967295


def test_perfquery_collector_marker_with_time_only() -> None:
    ev = read("perfquery", "perfquery_collector_time_only.txt")
    assert [(p.ca, p.sampled_at) for p in ev.ib_ports] == [
        ("lid1201", 1795830893.412),
        ("lid1201", 1795830895.416),
    ]
    assert ev.ib_ports[1].counters["PortXmitData"] - ev.ib_ports[0].counters["PortXmitData"] == 5876


def test_perfquery_failure_becomes_gaps() -> None:
    ev = read("perfquery", "perfquery_failed.txt")
    assert not ev.ib_ports
    assert any("Lid 1208" in g.message for g in ev.gaps)


def test_perfquery_all_ports_header() -> None:
    data = b"# Port counters: Lid 2 all ports (CapMask: 0x1600)\nSymbolErrorCounter:..............7\n"
    ev = Evidence()
    perfquery.parse(data, Source("p"), ev)
    assert [(p.ca, p.port, p.counters) for p in ev.ib_ports] == [("lid2", 255, {"SymbolErrorCounter": 7})]


# ---------------------------------------------------------------- ip link


def test_ip_link_gpu_node() -> None:
    ev = read("ip_link", "ip_link_gpu_node.txt")
    got = {link.ifname: (link.mtu, link.state) for link in ev.links}
    assert got == {
        "lo": (65536, "UNKNOWN"),
        "eno1": (1500, "UP"),
        "eno2": (1500, "DOWN"),
        "ens3np0": (9000, "UP"),
        "ens4np0": (1500, "UP"),
        "ibp26s0": (4092, "UP"),
        "ibp60s0": (4092, "UP"),
        "ibp204s0": (4092, "DOWN"),
        "docker0": (1500, "DOWN"),
        "veth3a1f2c0": (1500, "UP"),
    }
    down = next(link for link in ev.links if link.ifname == "ibp204s0")
    assert down.quote is not None and down.quote.line == 19 and "NO-CARRIER" in down.quote.text
    assert down.host == "gpu-node-03"


def test_ip_d_link_and_ip_addr() -> None:
    ev = read("ip_link", "ip_d_link_show.txt")
    assert [(link.ifname, link.mtu) for link in ev.links] == [
        ("lo", 65536),
        ("eno1", 1500),
        ("ibp26s0", 4092),
        ("ibp60s0", 2044),
    ]
    ev = read("ip_link", "ip_addr.txt")
    assert [(link.ifname, link.state) for link in ev.links] == [
        ("lo", "UNKNOWN"),
        ("eno1", "UP"),
        ("ibp26s0", "UP"),
        ("ibp204s0", "DOWN"),
    ]


def test_ip_o_link_one_line_per_interface() -> None:
    data = (
        b"2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP mode DEFAULT group default "
        b"qlen 1000\\    link/ether 02:fc:00:00:00:01 brd ff:ff:ff:ff:ff:ff\n"
        b"3: ib0: <BROADCAST,MULTICAST> mtu 2044 qdisc noop state DOWN mode DEFAULT group default qlen 256\\"
        b"    link/infiniband 80:00:00:02:fe:80 brd 00:ff:ff:ff:ff:12\n"
    )
    assert detect(data) is ip_link
    ev = Evidence()
    ip_link.parse(data, Source("ip"), ev)
    assert [(x.ifname, x.mtu, x.state) for x in ev.links] == [("eth0", 1500, "UP"), ("ib0", 2044, "DOWN")]


# ---------------------------------------------------------------- bad input

GARBAGE = b"lorem ipsum dolor sit amet\nconsectetur: adipiscing elit\n| not | a | table |\n1, 2, 3\n"
BINARY = bytes(range(256)) * 8 + os.urandom(512)


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("data", [b"", b"\n\n", GARBAGE, BINARY], ids=["empty", "blank", "garbage", "binary"])
def test_bad_input_never_raises_and_is_not_claimed(kind: str, data: bytes) -> None:
    mod = MODULES[kind]
    assert mod.sniff(data) == 0
    ev = Evidence()
    mod.parse(data, Source("bad"), ev)
    assert not ev.gpus and not ev.ib_ports and not ev.links and not ev.events


@pytest.mark.parametrize(("kind", "name"), all_fixtures())
def test_truncated_mid_line_keeps_what_came_before(kind: str, name: str) -> None:
    data = fixture(kind, name)
    cut = data[: max(1, len(data) * 2 // 3)]
    if cut.endswith(b"\n"):
        cut = cut[:-1]
    full, part = Evidence(), Evidence()
    MODULES[kind].parse(data, Source("f"), full)
    MODULES[kind].parse(cut, Source("f"), part)
    n_full = len(full.gpus) + len(full.ib_ports) + len(full.links) + len(full.events)
    n_part = len(part.gpus) + len(part.ib_ports) + len(part.links) + len(part.events)
    assert n_part <= n_full
    if n_full >= 3:
        assert n_part >= 1


def test_truncated_table_keeps_complete_gpus() -> None:
    data = fixture("nvidia_smi", "smi_535_h100_8gpu_one_idle.txt")
    cut = data[: data.index(b"00000000:5D:00.0") + 5]  # stops inside GPU 3's first row
    ev = Evidence()
    nvidia_smi.parse(cut, Source("f"), ev)
    assert [g.index for g in ev.gpus] == [0, 1, 2]
    assert all(g.util_pct == 100 for g in ev.gpus)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=600) | st.text(max_size=600).map(str.encode))
def test_fuzz_never_raises(data: bytes) -> None:
    for mod in MODULES.values():
        mod.sniff(data)
        mod.parse(data, Source("fuzz"), Evidence())


def test_older_kernel_wording_of_module_event_and_aer() -> None:
    data = (
        b"[   12.104411] mlx5_core 0000:0c:00.0: mlx5_port_module_event:1157:(pid 0): "
        b"Port module event[error]: module 0, Cable error, High Temperature\n"
        b"[   13.000001] pcieport 0000:00:1c.0: AER: Uncorrected (Non-Fatal) error message received "
        b"from 0000:02:00.0\n"
    )
    ev = Evidence()
    kernel_log.parse(data, Source("d"), ev)
    link, aer = ev.events
    assert (link.kind, link.fields["bus_id"], link.fields["state"], link.fields["cable"]) == (
        "nic_link",
        "0000:0c:00.0",
        "down",
        "error",
    )
    assert (aer.kind, aer.fields["bus_id"], aer.fields["severity"]) == (
        "pcie_error",
        "0000:02:00.0",
        "nonfatal",
    )
