"""`hangdx analyze` on saved artifacts: what an engineer has after the fact (logs, dumps, kernel logs).

The artifacts are the real-format fixtures of tests/fixtures (see the README in each folder).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIX = Path(__file__).parent.parent / "fixtures"


def analyze(*paths: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", *map(str, paths), "--json"],
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    "files, category, ranks",
    [
        (
            [
                "flight_recorder/gloo_rank0.pkl",
                "flight_recorder/gloo_rank1.pkl",
                "flight_recorder/gloo_rank2.pkl",
                "flight_recorder/gloo_rank3.pkl",
            ],
            "conditional_collective",
            [2],
        ),
        (
            [
                "flight_recorder/gloo_rank0.json",
                "flight_recorder/gloo_rank1.json",
                "flight_recorder/gloo_rank2.json",
                "flight_recorder/gloo_rank3.json",
            ],
            "conditional_collective",
            [2],
        ),
        (
            [
                "flight_recorder/nccl_trace_rank_0",
                "flight_recorder/nccl_trace_rank_1",
                "flight_recorder/nccl_trace_rank_2",
                "flight_recorder/nccl_trace_rank_3",
            ],
            "conditional_collective",
            [3],
        ),
        (["torch_log/ddp_unused_info.log"], "ddp_unused_parameters", [1]),
        (["torch_log/ddp_unused_default.log"], "ddp_unused_parameters", [1]),
        (["torch_log/torchrun_sigkill.log"], "rank_crashed", [1]),
        (["torch_log/rank_exception.log"], "rank_crashed", [1]),
        (["torch_log/cuda_oom_rank1.log"], "rank_crashed", [1]),
        (["torch_log/nccl_watchdog_desync.log"], "conditional_collective", [7]),
        (["torch_log/monitored_barrier.log"], "conditional_collective", [1, 2]),
        (["torch_log/collective_mismatch_detail.log"], "collective_mismatch", [0, 1]),
    ],
)
def test_offline_artifacts_name_category_and_culprit_rank(files, category, ranks):
    v = analyze(*(FIX / f for f in files))
    rc = v["root_cause"]
    assert (rc["category"], rc["culprit"]["ranks"]) == (category, ranks), rc["summary"]
    assert v["findings"][0]["evidence"], "a verdict must quote its proof"


def test_a_rank_that_died_of_a_timeout_is_not_blamed():
    v = analyze(FIX / "torch_log/gloo_recv_timeout.log")
    assert v["root_cause"]["category"] == "unknown"
    assert "Timed out waiting" in v["root_cause"]["summary"]


@pytest.mark.parametrize(
    "file, host, gpu",
    [
        ("kernel_log/journalctl_k_gpu-node-03.txt", "gpu-node-03", "gpu-node-03:0000:9b:00.0"),
        ("kernel_log/dmesg_xid79.txt", None, "0000:3b:00.0"),
    ],
)
def test_xid_lines_become_a_gpu_fault_with_host_and_gpu(file, host, gpu):
    rc = analyze(FIX / file)["root_cause"]
    assert rc["category"] == "gpu_fault"
    assert gpu in rc["culprit"]["gpus"]
    if host:
        assert rc["culprit"]["hosts"] == [host]


def test_rising_ib_error_counters_are_a_network_fault_on_that_port():
    rc = analyze(FIX / "perfquery/perfquery_x_two_samples_rising.txt")["root_cause"]
    assert rc["category"] == "network_fault" and rc["culprit"]["links"] == ["mlx5_7/1"]
    assert "SymbolErrorCounter" in rc["summary"]


def test_nccl_ib_completion_errors_are_a_network_fault_on_that_host_and_its_peer():
    rc = analyze(FIX / "nccl_log/ib_status_2.29.log")["root_cause"]
    # A completion that failed on the path to 10.20.0.8: both ends of the link are suspects.
    assert rc["category"] == "network_fault" and rc["culprit"]["hosts"] == ["10.20.0.8", "gpu-node-07"]


def test_a_folder_of_misnamed_files_is_read_by_content(tmp_path):
    (tmp_path / "output.dat").write_bytes((FIX / "torch_log/ddp_unused_info.log").read_bytes())
    (tmp_path / "nccl.log").write_bytes((FIX / "kernel_log/dmesg_xid79.txt").read_bytes())
    (tmp_path / "notes.txt").write_text("nothing to see here\n")
    v = analyze(tmp_path)
    found = {(f["category"], tuple(f["culprit"]["ranks"])) for f in v["findings"]}
    assert ("ddp_unused_parameters", (1,)) in found and ("gpu_fault", ()) in found
    assert any("notes.txt" in g and "not a known artifact" in g for g in v["gaps"])
