"""Real output of a real hung NCCL job on an NVIDIA H100, fed to the readers one file at a time.

tests/fixtures/gpu_live/h100_user_deadlock/ (its README says how it was recorded: driver 580.159.04, torch 2.11.0+cu130,
NCCL 2.28.9): two ranks share GPU 0; rank 1's main thread blocks on a lock its metrics-writer thread holds
(user_deadlock, rank 1), rank 0 goes on into step 6 and waits in `.item()` while NCCL's kernel spins the GPU at 100%;
the watchdog aborts rank 0 at SeqNum 23. Each test asserts what a user would check in that file, and quotes the lines
that say it. The files are read the way `hangdx analyze` reads them (probes/bundle.py `evidence_from_paths`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from hangdx.playbooks import engine
from hangdx.probes import waits
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.model import Evidence
from hangdx.probes.registry import detect

FIX = Path(__file__).resolve().parent.parent / "fixtures"
LIVE = FIX / "gpu_live" / "h100_user_deadlock"
UUID = "GPU-1256169d-d6c8-2256-b90b-4d3f3b4ef983"


def read(*names: str) -> Evidence:
    return evidence_from_paths([str(LIVE / n) for n in names])


def analyze(*names: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", *(str(LIVE / n) for n in names), "--json"],
        capture_output=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvidia-smi.hung.txt", "nvidia_smi"),
        ("nvidia-smi.idle.txt", "nvidia_smi"),
        ("nvidia-smi-query.hung.csv", "nvidia_smi"),
        ("nvidia-smi-apps.hung.csv", "nvidia_smi"),
        ("nvidia-smi-q.hung.txt", "nvidia_smi_q"),
        ("ncclras-v.txt", "ncclras"),
        ("ncclras.json", "ncclras"),
        ("nccl_trace_rank_0", "flight_recorder"),
        ("nccl_trace_rank_1", "flight_recorder"),
        ("pyspy-native.522.txt", "pyspy"),
        ("pyspy-native.523.txt", "pyspy"),
    ],
)
def test_each_real_file_is_detected_as_what_wrote_it(name, kind):
    mod = detect((LIVE / name).read_bytes()[:65536])
    assert mod is not None and mod.KIND == kind
    assert read(name).gaps == []


# -- nvidia-smi, the default table ---------------------------------------------------------------------------


def test_nvidia_smi_table_while_hung_one_gpu_at_100_percent_running_both_ranks():
    ev = read("nvidia-smi.hung.txt")
    # |   0  NVIDIA H100 80GB HBM3          On  |   00000000:00:06.0 Off |                    0 |
    # | N/A   36C    P0            119W /  700W |    2595MiB /  81559MiB |    100%      Default |
    (g,) = ev.gpus
    assert g.index == 0 and g.name == "NVIDIA H100 80GB HBM3"
    assert g.bus_id == "0000:00:06.0"  # nvidia-smi's 8-digit domain 00000000, as every reader writes it
    assert "00000000:00:06.0" in g.quote.text and g.quote.line == 9
    assert g.util_pct == 100
    assert (g.power_w, g.power_limit_w) == (119, 700)
    assert (g.mem_used_mib, g.mem_total_mib) == (2595, 81559)
    # |    0   N/A  N/A             522      C   python3                                1290MiB |
    # |    0   N/A  N/A             523      C   python3                                1290MiB |
    assert g.pids == [522, 523]
    # `Volatile Uncorr. ECC` reads 0, no ERR!: nothing for the GPU fault playbook
    assert ev.events == []


def test_nvidia_smi_table_idle_has_no_processes():
    ev = read("nvidia-smi.idle.txt")
    # | N/A   34C    P0             71W /  700W |       0MiB /  81559MiB |      0%      Default |
    # |  No running processes found                                                             |
    (g,) = ev.gpus
    assert g.index == 0 and g.bus_id == "0000:00:06.0"
    assert (g.util_pct, g.power_w, g.mem_used_mib) == (0, 71, 0)
    assert g.pids == []
    assert ev.events == []  # "No running processes found" is no failure message


def test_nvidia_smi_table_alone_is_no_gpu_fault():
    v = engine.run(read("nvidia-smi.hung.txt"))
    assert all(f.category != "gpu_fault" for f in v.findings)


# -- nvidia-smi -q ------------------------------------------------------------------------------------------


def test_nvidia_smi_q_reads_the_gpu_and_claims_no_fault():
    ev = read("nvidia-smi-q.hung.txt")
    (g,) = ev.gpus
    # Attached GPUs : 1 / GPU 00000000:00:06.0 / Product Name : NVIDIA H100 80GB HBM3 / GPU UUID : GPU-1256169d-...
    assert g.index == 0 and g.bus_id == "0000:00:06.0"
    assert g.name == "NVIDIA H100 80GB HBM3" and g.uuid == UUID
    # Utilization > GPU : 100 %; FB Memory Usage > Total : 81559 MiB, Used : 2595 MiB
    assert g.util_pct == 100 and (g.mem_used_mib, g.mem_total_mib) == (2595, 81559)
    # GPU Power Readings > Average Power Draw : 119.12 W (driver 580 prints no plain `Power Draw` any more),
    # Current Power Limit : 700.00 W
    assert (g.power_w, g.power_limit_w) == (119.12, 700)
    # Processes > Process ID : 522 / Process ID : 523
    assert g.pids == [522, 523]
    # ECC Errors > Volatile > SRAM Uncorrectable Parity/SEC-DED : 0, DRAM Uncorrectable : 0;
    # Retired Pages > Pending Page Blacklist : N/A; Remapped Rows > Pending : No, Remapping Failure Occurred : No;
    # GPU Recovery Action : None; Clocks Event Reasons all Not Active: no memory error, no throttling, no Xid
    assert ev.events == []
    v = engine.run(ev)
    assert all(f.category != "gpu_fault" for f in v.findings)


def _q_with(old: str, new: str) -> bytes:
    data = (LIVE / "nvidia-smi-q.hung.txt").read_text()
    assert data.count(old) == 1
    return data.replace(old, new).encode()


@pytest.mark.parametrize(
    "value, problem",
    [
        ("Reset", "recovery_reset"),
        ("Reboot", "recovery_reboot"),
        ("Drain P2P", "recovery_drain_p2p"),
        ("Drain and Reset", "recovery_drain_and_reset"),
    ],
)
def test_nvidia_smi_q_gpu_recovery_action_other_than_none_is_a_gpu_fault(tmp_path, value, problem):
    # Driver 580's report has no `GPU Reset Status` section (550's `Reset Required`); `GPU Recovery Action` says it.
    # The real report with that one line set as a faulted GPU prints it (values: NVIDIA's GPU memory error
    # management guide, "Error Recovery and Response Flags"; `Reset` / `Reboot` as pasted from real machines).
    line = "    GPU Recovery Action                                : None"
    p = tmp_path / "nvidia-smi-q.txt"
    p.write_bytes(_q_with(line, line.replace("None", value)))
    ev = evidence_from_paths([str(p)])
    (e,) = ev.events_of("gpu_memory_error")
    assert e.fields["problem"] == problem and e.fields["recovery_action"] == value
    assert e.fields["bus_id"] == "0000:00:06.0" and e.quote.text.rstrip().endswith(value)
    rc = engine.run(ev).root_cause
    assert rc.category == "gpu_fault" and rc.culprit.gpus == ["0000:00:06.0"]


def test_nvidia_smi_q_550_power_readings_are_still_read():
    # q_a10_550_clean_full.txt: `Power Draw : 21.30 W`, `Current Power Limit : 150.00 W` (driver 550.127.05)
    (g,) = evidence_from_paths([str(FIX / "nvidia_smi_q" / "q_a10_550_clean_full.txt")]).gpus
    assert (g.power_w, g.power_limit_w) == (21.30, 150)


# -- nvidia-smi --query-gpu / --query-compute-apps CSV ---------------------------------------------------------


def test_query_gpu_csv():
    # 0, GPU-1256169d-..., 00000000:00:06.0, NVIDIA H100 80GB HBM3, 100 %, 2595 MiB, 81559 MiB, 119.11 W, 700.00 W, 36, 1980 MHz
    ev = read("nvidia-smi-query.hung.csv")
    (g,) = ev.gpus
    assert (g.index, g.uuid, g.bus_id, g.name) == (0, UUID, "0000:00:06.0", "NVIDIA H100 80GB HBM3")
    assert g.util_pct == 100
    assert (g.power_w, g.power_limit_w) == (119.11, 700)
    assert (g.mem_used_mib, g.mem_total_mib) == (2595, 81559)
    assert ev.events == []


def test_query_compute_apps_csv_joins_the_gpu_in_either_order():
    # 523, python3, GPU-1256169d-..., 1290 MiB
    # 522, python3, GPU-1256169d-..., 1290 MiB
    apps = read("nvidia-smi-apps.hung.csv")
    procs = apps.events_of("gpu_process")
    assert [(e.pid, e.fields["gpu_uuid"], e.fields["used_memory_mib"]) for e in procs] == [
        (523, UUID, 1290),
        (522, UUID, 1290),
    ]
    for names in (
        ("nvidia-smi-query.hung.csv", "nvidia-smi-apps.hung.csv"),
        ("nvidia-smi-apps.hung.csv", "nvidia-smi-query.hung.csv"),
    ):
        (g,) = read(*names).gpus
        assert sorted(g.pids) == [522, 523]


# -- NCCL RAS (NCCL 2.28.9) -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, fmt", [("ncclras-v.txt", "text"), ("ncclras.json", "json")])
def test_ncclras_one_communicator_rank_1_three_allreduces_behind(name, fmt):
    (rep,) = read(name).events_of("ncclras_report")
    assert rep.fields["format"] == fmt and rep.fields["version"] == "2.28.9"
    # text: `0  1  1  2  2  2  RUNNING  MISMATCH`; json: "communicators_count": 1, "size": 2
    (comm,) = rep.fields["comms"]
    assert comm["hash"] == "1781493affa4c473" and comm["size"] == 2
    assert rep.fields["dead"] == [] and rep.fields["unreachable"] == [] and comm["missing"] == {}
    assert rep.fields["timeouts"] == 0
    # text: "Rank 0 has launched up to operation 20 -- GPU 0 managed by process 522 on node 127.0.0.1"
    #       "Rank 1 has launched up to operation 17 -- GPU 0 managed by process 523 on node 127.0.0.1"
    # json: "AllReduce": 20 for rank 0 (pid 522), "AllReduce": 17 for rank 1 (pid 523), both "host": "127.0.0.1"
    assert list(comm["counts"]) == ["AllReduce"]  # Broadcast 4 and AllGather 1 agree on both ranks
    ranks = {}
    for group in comm["counts"]["AllReduce"]["groups"]:
        for rank, info in group["ranks"].items():
            ranks[rank] = (group["value"], info["host"], info["pid"], info["gpu"])
    assert ranks == {0: (20, "127.0.0.1", 522, "0"), 1: (17, "127.0.0.1", 523, "0")}
    if fmt == "text":
        (row,) = rep.fields["table"]
        assert (row["status"], row["errors"], row["size"]) == ("RUNNING", "MISMATCH", 2)


@pytest.mark.parametrize("name", ["ncclras-v.txt", "ncclras.json"])
def test_ncclras_alone_names_rank_1_the_rank_behind(name):
    v = engine.run(read(name))
    (f,) = [f for f in v.findings if f.playbook == "ncclras"]
    assert f.culprit.ranks == [1]
    assert f.category not in ("gpu_fault", "network_fault")


# -- Flight Recorder (ProcessGroupNCCL's pickles, torch 2.11) ------------------------------------------------


def test_flight_recorder_rank_0_enqueued_past_rank_1():
    ev = read("nccl_trace_rank_0", "nccl_trace_rank_1")
    dumps = {e.rank: e.fields for e in ev.events_of("fr_dump")}
    # pickle: "version": "2.10", "comm_lib_version": "2.28.9", pg_config {"0": {"desc": "default_pg", "ranks": "[0, 1]"}}
    assert {d["version"] for d in dumps.values()} == {"2.10"}
    assert {d["comm_lib_version"] for d in dumps.values()} == {"2.28.9"}
    assert dumps[0]["pg_ranks"] == {"0": [0, 1]}
    # rank 0: pg_status {"0": {"last_enqueued_collective": 25, "last_started_collective": -1,
    #                           "last_completed_collective": 22}} (the stderr: "last enqueued work: 25, last completed
    #                           work: 22"); entries 23-25 "state": "scheduled", "retired": False
    assert dumps[0]["pg_status"]["0"] == {"last_enqueued": 25, "last_started": -1, "last_completed": 22}
    assert dumps[0]["last_completed_seq"] == 22 and dumps[0]["pending_seqs"] == [23, 24, 25]
    # rank 1: last_enqueued 22, last_completed 22 ("Last enqueued NCCL work: 22, last completed NCCL work: 22")
    assert dumps[1]["pg_status"]["0"] == {"last_enqueued": 22, "last_started": -1, "last_completed": 22}
    assert dumps[1]["last_completed_seq"] == 22 and dumps[1]["pending_seqs"] == []
    last = {r: max(c.seq for c in ev.collectives if c.rank == r) for r in (0, 1)}
    assert last == {0: 25, 1: 22}
    # seq 23, the one the watchdog timed out: nccl:all_reduce of 4195328 floats (NumelIn=4195328), not completed
    (c23,) = [c for c in ev.collectives if c.rank == 0 and c.seq == 23]
    assert (c23.op, c23.numel_in, c23.state) == ("allreduce", 4195328, "scheduled")
    assert {c.state for c in ev.collectives if c.rank == 1} == {"completed"}


def test_flight_recorder_counts_agree_with_what_ras_counted():
    # Two independent records of the same job: NCCL RAS counted AllReduce 20 / 17, Broadcast 4, AllGather 1
    # (ncclras.json "collective_counts"); Flight Recorder recorded each collective the ranks enqueued.
    ev = read("nccl_trace_rank_0", "nccl_trace_rank_1")
    counts = {r: Counter(c.op for c in ev.collectives if c.rank == r) for r in (0, 1)}
    assert counts[0] == {"allreduce": 20, "broadcast": 4, "allgather": 1}
    assert counts[1] == {"allreduce": 17, "broadcast": 4, "allgather": 1}


# -- hangdx analyze: torchrun's stderr, then with the pickles -------------------------------------------------

WATCHDOG = (
    "[rank0]:[E1127 17:50:48.450959182 ProcessGroupNCCL.cpp:689] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=23, OpType=ALLREDUCE, NumelIn=4195328, NumelOut=4195328, Timeout(ms)=50000) ran for "
    "50055 milliseconds before timing out."
)


def test_stderr_watchdog_timeout_is_read():
    ev = read("torchrun.stderr.txt")
    (e,) = ev.events_of("watchdog_timeout")
    assert e.rank == 0 and e.quote.text == WATCHDOG and e.quote.line == 11
    f = e.fields
    assert (f["seq"], f["op"], f["timeout_ms"], f["ran_ms"], f["numel_in"]) == (
        23,
        "allreduce",
        50000,
        50055,
        4195328,
    )
    # "... Rank 0] failure detected by watchdog at work sequence id: 23 PG status: last enqueued work: 25, last
    # completed work: 22" and rank 1's "Last enqueued NCCL work: 22, last completed NCCL work: 22."
    progress = {
        (p.rank, p.fields["last_enqueued"], p.fields["last_completed"]) for p in ev.events_of("work_progress")
    }
    assert progress == {(0, 25, 22), (1, 22, 22)}
    # torchrun's table: "[0]: ... rank : 0 (local_rank: 0) exitcode : -6 (pid: 522) ... Signal 6 (SIGABRT)"
    failures = {
        (t.rank, t.pid, t.fields["exitcode"], t.fields["root_cause"])
        for t in ev.events_of("torchrun_failure")
    }
    assert failures == {(0, 522, -6, True), (1, 523, -15, False)}


def test_analyze_stderr_quotes_the_watchdog_and_blames_no_hardware():
    out = analyze("torchrun.stderr.txt")
    quoted = [q["text"] for f in out["findings"] for q in f["evidence"]]
    assert WATCHDOG in quoted
    assert out["root_cause"]["category"] not in ("gpu_fault", "network_fault")
    assert all(f["category"] not in ("gpu_fault", "network_fault") for f in out["findings"])
    # rank 1 enqueued nothing past 22 while rank 0 went to 25: the rank behind
    assert out["root_cause"]["culprit"]["ranks"] == [1]


def test_analyze_stderr_and_both_pickles_name_rank_1():
    out = analyze("torchrun.stderr.txt", "nccl_trace_rank_0", "nccl_trace_rank_1")
    rc = out["root_cause"]
    assert rc["culprit"]["ranks"] == [1]
    assert rc["category"] not in ("gpu_fault", "network_fault")
    top = out["findings"][0]
    sources = {q["source"] for q in top["evidence"]}
    assert {"nccl_trace_rank_0", "nccl_trace_rank_1", "torchrun.stderr.txt"} <= sources
    # "#21 pg=0:default_pg seq=22 nccl:all_reduce state=completed retired in=[[]] Float": rank 1's last
    assert any(q["source"] == "nccl_trace_rank_1" and "seq=22" in q["text"] for q in top["evidence"])


# -- py-spy dump --native --------------------------------------------------------------------------------------


def _main(ev: Evidence, pid: int):
    (dump,) = [s for s in ev.stacks if s.pid == pid]
    (t,) = [t for t in dump.threads if t.name == "MainThread"]
    return dump, t


def test_pyspy_native_rank_0_main_thread_waits_in_a_cuda_sync_under_item():
    ev = read("pyspy-native.522.txt")
    # Process 522: python3 /work/main/tests/fixtures/gpu_live/hung_job.py / Python v3.12.3 (/usr/bin/python3.12)
    dump, t = _main(ev, 522)
    assert dump.python == "3.12.3" and dump.command.endswith("hung_job.py")
    # Thread 522 (active): "MainThread" (the CPU spins in cuStreamSynchronize)
    assert t.tid == 522 and t.state == "active"
    names = [f.function for f in t.frames]
    # cuStreamSynchronize (libcuda.so.580.159.04) ... cudaStreamSynchronize (libcudart.so.13) ...
    # at::native::item (libtorch_cpu.so) ... torch::autograd::THPVariable_item (libtorch_python.so)
    # train (hung_job.py:58) / <module> (hung_job.py:69)
    assert names.index("cudaStreamSynchronize") < names.index("at::native::item") < names.index("train")
    assert all(f.native for f in t.frames[: names.index("train")])
    train = t.frames[names.index("train")]
    assert (train.native, train.file, train.line) == (False, "hung_job.py", 58)
    assert t.frames[0].function == "0x7f150c151fa0" and t.frames[0].file == "libcuda.so.580.159.04"
    w = waits.classify(t.frames, idle=t.state not in ("active", "gil"))
    assert (w.kind, w.op, w.row.id) == ("collective", "sync", "native_cuda_sync")
    assert w.frame.function == "cudaStreamSynchronize"


def test_pyspy_native_rank_1_main_thread_waits_for_a_lock():
    ev = read("pyspy-native.523.txt")
    dump, t = _main(ev, 523)
    # Thread 523 (idle): "MainThread"
    #     0x7fb656898e51 (libc.so.6) / 0x7fb6568a5098 (libc.so.6) / PyThread_acquire_lock_timed (python3.12)
    #     log_metrics (hung_job.py:33) / train (hung_job.py:63) / <module> (hung_job.py:69)
    assert t.state == "idle"
    assert [(f.function, f.line) for f in t.frames if not f.native] == [
        ("log_metrics", 33),
        ("train", 63),
        ("<module>", 69),
    ]
    w = waits.classify(t.frames, idle=True)
    assert w.kind == "lock" and w.frame.function == "PyThread_acquire_lock_timed"
    # Thread 609 (idle): "metrics-writer" ... Queue.get (queue.py:171) / metrics_writer (hung_job.py:29)
    (writer,) = [x for x in dump.threads if x.name == "metrics-writer"]
    ww = waits.classify(writer.frames, idle=True)
    assert ww.frame.function == "Queue.get" and ww.op == "get"
