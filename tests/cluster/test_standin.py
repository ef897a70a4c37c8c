"""The simulated nodes' stand-in tools and the scenarios' recorded outputs, without starting a cluster.

The renderers must reproduce the recorded fixtures byte for byte (tests/fixtures/nvidia_smi, perfquery,
ibstat, ip_link, kernel_log: see each folder's README for where the formats come from), and the stand-ins
must answer the way the real tools do for the arguments hangdx's collector uses.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from . import scenarios, standin
from .sim import FIXTURES, NodeSpec, quiet_kernel_log

SMI = FIXTURES / "nvidia_smi"


def fixture_gpus() -> list[scenarios.Gpu]:
    """The 8 H100s of the recorded node, with the table's temperatures and watts."""
    table = (SMI / "smi_535_h100_8gpu_one_idle.txt").read_text()
    temps = [int(t) for t in re.findall(r"\| N/A\s+(\d+)C", table)]
    rows = [r.split(", ") for r in (SMI / "query_gpu_8xh100_one_idle.csv").read_text().splitlines()[1:]]
    return [
        scenarios.Gpu(
            i,
            r[1],
            r[2],
            util=int(r[4].split()[0]),
            mem_used=int(r[5].split()[0]),
            power=float(r[7].split()[0]),
            temp=temps[i],
        )
        for i, r in enumerate(rows)
    ]


FIXTURE_PIDS = {i: 2214871 + i for i in range(8)}


def test_smi_table_reproduces_the_recorded_535_table() -> None:
    gpus = fixture_gpus()
    # The recorded table shows whole watts that are not always the CSV's rounded down: take the table's.
    table = (SMI / "smi_535_h100_8gpu_one_idle.txt").read_text()
    for g, watts in zip(gpus, re.findall(r"(\d+)W / 700W", table), strict=True):
        g.power = float(watts)
    when = time.mktime(time.strptime("Sun Nov 22 01:14:52 2026", "%a %b %d %H:%M:%S %Y"))
    rendered = scenarios.smi_table_535(gpus, when, process_name="/usr/bin/python3")
    assert standin.render(rendered, "gpu-node", FIXTURE_PIDS) == table


def test_query_csvs_reproduce_the_recorded_csvs() -> None:
    gpus = fixture_gpus()
    assert scenarios.query_gpu_csv(gpus) == (SMI / "query_gpu_8xh100_one_idle.csv").read_text()
    apps = scenarios.compute_apps_csv(gpus, process_name="/usr/bin/python3")
    assert standin.render(apps, "gpu-node", FIXTURE_PIDS) == (SMI / "compute_apps.csv").read_text()


def test_render_fills_pids_and_drops_dead_ranks_for_nvidia_smi() -> None:
    text = "pid, name\n%PID0%, a\n%PID1%, b\n%PID2%, c\n|   %PID0%  C |\non %HOST%\n"
    dead = 2**22 + 12345  # above pid_max's default: no such process
    pids = {0: os.getpid(), 1: dead}
    assert standin.render(text, "node-07", pids, live_only=True) == (
        f"pid, name\n{os.getpid()}, a\n|   {os.getpid():>6}  C |\non node-07\n"
    )
    # The kernel log keeps lines about dead processes (and unknown placeholders as they are).
    assert f"{dead}, b" in standin.render(text, "node-07", pids)
    assert "%PID2%, c" in standin.render(text, "node-07", pids)


def test_nvidia_smi_answers_by_the_longest_argument_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    spec = {
        "": {"stdout": "table\n"},
        "--query-gpu=": {"stdout": "gpus\n"},
        "--query-gpu=index": {"stdout": "index only\n", "returncode": 0},
    }
    assert standin.nvidia_smi(spec, ["--query-gpu=index", "--format=csv"], "n", {}) == 0
    assert capsys.readouterr().out == "index only\n"
    assert standin.nvidia_smi(spec, [], "n", {}) == 0
    assert capsys.readouterr().out == "table\n"
    assert standin.nvidia_smi({"--query-gpu=": {"stdout": "x"}}, ["-L"], "n", {}) == 2
    assert "Invalid combination of input arguments" in capsys.readouterr().out
    lost = scenarios.smi_lost("00000000:3B:00.0")[""]
    assert lost.returncode == 255
    assert lost.stdout == (SMI / "gpu_lost_unknown_error.txt").read_text()


def test_perfquery_gives_each_port_its_successive_samples(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = scenarios.perfquery_ports(1, bad_port="mlx5_0")
    seen = []
    for _ in range(4):
        assert standin.perfquery(samples, ["-x", "-C", "mlx5_0", "-P", "1"], str(tmp_path)) == 0
        seen.append(int(re.search(r"^SymbolErrorCounter:\.+(\d+)$", capsys.readouterr().out, re.M).group(1)))
    assert seen == [1204, 1587, 1970, 2353]
    # Other ports count their own calls and stay quiet; no -C means the first port.
    assert standin.perfquery(samples, ["-x", "-C", "mlx5_1", "-P", "1"], str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("# Port extended counters: Lid 1218 port 1 ")
        and "SymbolErrorCounter:..............0\n" in out
    )
    assert standin.perfquery(samples, ["-x"], str(tmp_path)) == 0
    assert "SymbolErrorCounter:..............2736" in capsys.readouterr().out
    # A RoCE port takes no MADs.
    assert standin.perfquery(samples, ["-x", "-C", "mlx5_4", "-P", "1"], str(tmp_path)) == 255
    err = capsys.readouterr().err.splitlines()
    assert re.match(r"ibwarn: \[\d+\] mad_rpc_open_port: client_register for mgmt 1 failed$", err[0])
    assert err[1] == "perfquery: iberror: failed: Failed to open 'mlx5_4' port '1'"


def test_perfquery_samples_are_the_recorded_blocks() -> None:
    recorded = (FIXTURES / "perfquery" / "perfquery_x_two_samples_rising.txt").read_text()
    for block in scenarios.perfquery_samples(0, "mlx5_9", failing=True) + scenarios.perfquery_samples(
        0, "mlx5_0", False
    ):
        assert (
            block in recorded
        )  # the same lines, marker taken off (mlx5_9's and mlx5_0's lids are the recording's)
        assert block.startswith("# Port extended counters: Lid ") and block.endswith(
            "QP1Dropped:......................0\n"
        )


def test_extrapolate_keeps_the_dot_padding() -> None:
    before = "PortXmitData:....................9\nCounterSelect:...................0x0000\n"
    last = "PortXmitData:....................99\nCounterSelect:...................0x0000\n"
    assert (
        standin.extrapolate(before, last, 2)
        == "PortXmitData:....................279\nCounterSelect:...................0x0000\n"
    )


def test_dmesg_converts_raw_stamps_like_dmesg(capsys: pytest.CaptureFixture[str]) -> None:
    text = scenarios.xid79().node_specs[1].dmesg
    assert text is not None
    boot = time.mktime((2026, 11, 14, 6, 0, 0, 0, 0, -1))
    assert standin.dmesg(text, boot, []) == 0
    assert capsys.readouterr().out == text  # no option: raw, as recorded
    standin.dmesg(text, boot, ["--ctime"])
    out = capsys.readouterr().out.splitlines()
    xid = next(line for line in out if "Xid" in line)
    assert (
        xid
        == "[Sun Nov 22 11:51:41 2026] NVRM: Xid (PCI:0000:18:00): 79, pid=%PID0%, name=python, GPU has fallen off the bus."
    )
    # Continuation lines of a multi-line message are indented to the new prefix's width.
    cont = next(line for line in out if "nvidia-bug-report.sh" in line)
    assert (
        cont
        == " " * len("[Sun Nov 22 11:51:41 2026] ")
        + "NVRM: nvidia-bug-report.sh as root to collect this data before"
    )
    standin.dmesg(text, boot, ["--time-format", "iso"])
    iso = next(line for line in capsys.readouterr().out.splitlines() if "Xid" in line)
    assert re.match(r"^2026-11-22T11:51:41,118236[+-]\d\d:\d\d NVRM: Xid", iso)


def test_dmesg_already_in_ctime_format_prints_as_is(capsys: pytest.CaptureFixture[str]) -> None:
    text = (FIXTURES / "kernel_log" / "dmesg_T_ecc_oom.txt").read_text()
    standin.dmesg(text, 0.0, ["--ctime"])
    assert capsys.readouterr().out == text


def test_ibstat_lists_cas_and_prints_one(capsys: pytest.CaptureFixture[str]) -> None:
    healthy, bad = scenarios.ibstat_text(0), scenarios.ibstat_text(1, down="mlx5_0")
    assert "State: Down" not in healthy and healthy.count("State: Active") == 10
    assert bad.count("State: Down") == 1 and "Base lid: 65535" in bad
    assert standin.ibstat(bad, ["-l"]) == 0
    assert capsys.readouterr().out.split() == [f"mlx5_{i}" for i in range(10)]
    assert standin.ibstat(bad, ["mlx5_0"]) == 0
    block = capsys.readouterr().out
    assert block.startswith("CA 'mlx5_0'\n") and "Physical state: Polling" in block and "mlx5_1" not in block
    assert standin.ibstat(bad, ["mlx5_42"]) == 255
    # Only ids and port states differ from the recording.
    recorded = (FIXTURES / "ibstat" / "ibstat_10hca_mlx5_7_polling.txt").read_text()
    assert len(bad.splitlines()) == len(recorded.splitlines())


def test_ip_link_text_changes_only_mtus_ids_and_the_down_ipoib_port() -> None:
    recorded = (FIXTURES / "ip_link" / "ip_link_gpu_node.txt").read_text().splitlines()
    odd = scenarios.ip_link_text(2, {"ens3np0": 1500}).splitlines()
    assert len(odd) == len(recorded)
    header = {line.split(":")[1].strip(): line for line in odd if re.match(r"^\d+: ", line)}
    assert header["ens3np0"].startswith(
        "4: ens3np0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP "
    )
    assert " mtu 9000 " in header["ens4np0"]
    assert header["ibp204s0"].startswith(
        "8: ibp204s0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 4092 qdisc mq state UP "
    )
    assert header["eno2"] == next(line for line in recorded if line.startswith("3: eno2:"))
    assert scenarios.ip_link_text(0) != scenarios.ip_link_text(1)  # MACs are per node


def test_nccl_log_placeholders_and_formats() -> None:
    log = scenarios.nccl_log(1, 1, 3, 2, 2, {"ca": "mlx5_0", "peer": "127.0.0.11"})
    lines = log.splitlines()
    assert lines[0] == "%HOST%:%PID1%:%PID1% [1] NCCL INFO Bootstrap: Using eno1:127.0.0.12<0>"
    assert re.match(
        r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] %HOST%:%PID1%:%PID1\+91% \[1\] transport/net_ib/p2p.cc:550 NCCL WARN NET/IB: "
        r"Got completion from peer 127.0.0.11<52311> with status=IBV_WC_RETRY_EXC_ERR\(12\)",
        lines[-4],
    )
    assert "NCCL WARN" not in scenarios.nccl_log(0, 0, 0, 2, 2)


def test_scenarios_expected_values() -> None:
    assert {name: build().expected["category"] for name, build in scenarios.SCENARIOS.items()} == {
        "gpu_idle": "conditional_collective",
        "ib_link_flap": "network_fault",
        "xid79": "gpu_fault",
        "sshd_down": "conditional_collective",
        "mtu_mismatch": "network_fault",
        "dataloader_hang": "dataloader_stall",
        "rank_killed": "rank_crashed",
        "ras_rank_killed": "rank_crashed",
    }
    for build in scenarios.SCENARIOS.values():
        s = build()
        assert s.nodes * s.ranks_per_node == 4  # quick to start on 2 cores
        assert all(isinstance(v, NodeSpec) for v in s.node_specs.values())
    with pytest.raises(ValueError):
        scenarios.sshd_down(down=1)  # the culprit (rank 1) would be on the unreachable node


def test_quiet_kernel_log_has_no_fault() -> None:
    text = quiet_kernel_log()
    assert "Xid" not in text and "DOWN" not in text and len(text.splitlines()) == 5


def test_ncclras_prints_text_or_json_as_the_real_client_does(capsys: pytest.CaptureFixture[str]) -> None:
    report = scenarios.SCENARIOS["ras_rank_killed"]().node_specs[0].ncclras
    assert report is not None
    assert standin.ncclras(report, ["-t", "5", "-v"]) == 0
    assert "  Rank 2 -- GPU 0 managed by process 51202 on node 127.0.0.12" in capsys.readouterr().out
    assert standin.ncclras(report, ["-t", "5", "-f", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["communicators"][0]["missing_ranks"][0]["rank"] == 2
    assert standin.ncclras(report, ["-f", "yaml"]) == 1
    assert "Invalid format: yaml (must be text or json)" in capsys.readouterr().err
