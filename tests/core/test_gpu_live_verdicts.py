"""What hangdx concludes from a real hung NCCL job recorded on an H100 (tests/fixtures/gpu_live/README.md).

Rank 1 blocks on a lock its own `metrics-writer` thread holds while that thread waits on a queue; rank 0 has
queued DDP's and the loss's all-reduces on the GPU and its CPU spins in `.item()` (cudaStreamSynchronize), so its
Python stack shows only its own line, `train (hung_job.py:58)`, "active". The truth: user_deadlock, rank 1.
Live, hangdx answered conditional_collective at 0.5 (diagnose.json): the stacks formed no crowd in a collective.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hangdx.probes.collector import _busy_in_place

REC = Path(__file__).parent.parent / "fixtures" / "gpu_live" / "h100_user_deadlock"


def analyze(*paths: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", *map(str, paths), "--json"],
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def _samples(path: Path) -> list[str]:
    return path.read_text().split("# hangdx stack-sample")[1:]


def test_the_recorded_live_verdict_is_the_miss_this_fixes():
    # The record of what hangdx said live on the GPU: kept, not rewritten.
    live = json.loads((REC / "diagnose.json").read_text())
    assert live["root_cause"]["category"] == "conditional_collective"
    assert live["root_cause"]["confidence"] == 0.5


def test_ras_counts_make_the_ranks_ahead_the_crowd_and_the_rank_behind_is_where_its_stack_is():
    # ncclras.txt: "Rank 0 has launched up to operation 20", "Rank 1 has launched up to operation 17";
    # stacks-rank1: log_metrics (hung_job.py:33) under thread "metrics-writer" in Queue.get.
    v = analyze(REC / "bundle")
    rc = v["root_cause"]
    assert rc["category"] == "user_deadlock", rc
    assert rc["culprit"]["ranks"] == [1]
    assert "log_metrics (hung_job.py:33)" in rc["summary"]
    assert "metrics-writer" in rc["summary"]
    assert any("operation 17" in e["text"] for f in v["findings"] for e in f["evidence"])


def test_a_native_sample_shows_the_busy_rank_waits_in_a_cuda_synchronisation(tmp_path):
    # What the collector now adds when a main thread is active on one line in every sample: a `--native` dump.
    # Here the real `py-spy dump --native` of rank 0 (pyspy-native.522.txt) is appended as that sample, and the
    # RAS reports are left out, so that the stacks alone must say it.
    bundle = tmp_path / "bundle"
    shutil.copytree(REC / "bundle", bundle)
    for f in (bundle / "vm").glob("ncclras*"):
        f.unlink()
    stacks = bundle / "vm" / "stacks-rank0-pid522.txt"
    with stacks.open("a") as out:
        out.write("\n# hangdx stack-sample time=1795801811.000 host=vm rank=0 pid=522 role=rank native=1\n")
        out.write((REC / "pyspy-native.522.txt").read_text())
    v = analyze(bundle)
    rc = v["root_cause"]
    assert rc["category"] == "user_deadlock", rc
    assert rc["culprit"]["ranks"] == [1]
    assert "CUDA synchronisation" in rc["summary"]  # rank 0: cudaStreamSynchronize under at::native::item
    assert v["status"] == "hung"


def test_without_ras_or_native_frames_the_stacks_alone_do_not_invent_a_cause(tmp_path):
    # Python frames only: rank 0 "running its own code" at one line, rank 1 on a lock. No crowd waits in a
    # collective, so no playbook may call rank 1 the one that holds the others (nothing shows they wait).
    bundle = tmp_path / "bundle"
    shutil.copytree(REC / "bundle", bundle)
    for f in (bundle / "vm").glob("ncclras*"):
        f.unlink()
    v = analyze(bundle)
    assert v["root_cause"]["category"] not in ("conditional_collective", "gpu_fault", "network_fault")


def test_the_collector_asks_for_native_frames_only_where_python_frames_cannot_tell():
    # rank 0: 'Thread 522 (active): "MainThread"' at 'train (hung_job.py:58)' in all three samples;
    # rank 1: 'Thread 523 (idle): "MainThread"' at log_metrics: py-spy's Python frames already say it waits.
    assert _busy_in_place(_samples(REC / "bundle" / "vm" / "stacks-rank0-pid522.txt"))
    assert not _busy_in_place(_samples(REC / "bundle" / "vm" / "stacks-rank1-pid523.txt"))
    one = _samples(REC / "bundle" / "vm" / "stacks-rank0-pid522.txt")[:1]
    assert not _busy_in_place(one)  # one sample cannot show that it did not move


def test_live_flight_recorder_asks_the_nccl_handler_when_the_generic_one_is_empty(tmp_path):
    # A CUDA job's control plane: `fr_trace_json` answers the generic recorder, empty for an NCCL job (the body
    # below is what it answered on the H100, bundle/vm/fr-rank0.json); ProcessGroupNCCL's own recorder is
    # `dump_nccl_trace_json`. A CPU build has no such handler (404): the generic answer then stands.
    import http.server
    import socketserver
    import threading

    from hangdx.probes.collector import fetch_fr_trace

    empty = (REC / "bundle" / "vm" / "fr-rank0.json").read_text()
    asked: list[str] = []
    nccl = {"answer": (200, '{"version": "2.10", "entries": [{"collective_seq_id": 23}]}')}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            asked.append(self.path)
            code, body = (200, empty) if self.path == "/handler/fr_trace_json" else nccl["answer"]
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

        def address_string(self):
            return "unix"

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    sock = str(tmp_path / "rank0.sock")
    server = Server(sock, Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body, err = fetch_fr_trace(sock)
        assert err is None and '"collective_seq_id": 23' in body
        assert asked == [
            "/handler/fr_trace_json",
            "/handler/dump_nccl_trace_json?includecollectives=true&onlyactive=false",
        ]
        nccl["answer"] = (404, "Handler not found: dump_nccl_trace_json")
        body, err = fetch_fr_trace(sock)
        assert err is None and body == empty
    finally:
        server.shutdown()
        server.server_close()


REC2 = REC.parent / "h100_user_deadlock_2"
KILLED = REC.parent / "h100_rank_killed"


def test_second_run_live_verdict_was_right_and_reads_back_the_same():
    # Recorded with the native sample (rank 0's last sample, "native=1") and the NCCL Flight Recorder fetched live.
    live = json.loads((REC2 / "diagnose.json").read_text())
    assert live["root_cause"]["category"] == "user_deadlock"
    assert live["root_cause"]["culprit"]["ranks"] == [1]
    assert "native=1" in (REC2 / "bundle" / "vm" / "stacks-rank0-pid519.txt").read_text()
    fr = json.loads((REC2 / "bundle" / "vm" / "fr-rank0.json").read_text())
    assert (
        fr["comm_lib_version"] == "2.28.9" and fr["entries"]
    )  # ProcessGroupNCCL's own recorder, not the generic
    v = analyze(REC2 / "bundle")
    assert v["root_cause"]["category"] == "user_deadlock"
    assert v["root_cause"]["culprit"]["ranks"] == [1]


def test_a_killed_rank_is_the_cause_not_the_link_its_survivor_saw_close():
    # bundle: rank 1's process is gone (WORLD_SIZE=2, one rank found); nccl-rank0.log: "socketProgress: Connection
    # closed by remote peer"; ncclras.txt: "Missing communicator data from 1 rank ... Rank 1".
    live = json.loads((KILLED / "diagnose.json").read_text())
    assert live["root_cause"]["category"] == "network_fault"  # the record of the miss
    v = analyze(KILLED / "bundle")
    rc = v["root_cause"]
    assert rc["category"] == "rank_crashed", rc
    assert rc["culprit"]["ranks"] == [1]
    assert not any(
        f["category"] == "network_fault" and f["confidence"] >= rc["confidence"] for f in v["findings"]
    )


def test_the_watchdogs_own_abort_is_not_the_crash_that_caused_it():
    # rank0.stderr.txt: "ncclRemoteError: ... a remote process exiting prematurely", then "To avoid data
    # inconsistency, we are taking the entire process down" and "Fatal Python error: Aborted". Rank 0 aborted
    # itself because its peer died: rank 0 is not the culprit.
    v = analyze(KILLED / "rank0.stderr.txt")
    rc = v["root_cause"]
    assert rc["category"] == "rank_crashed"
    assert 0 not in rc["culprit"]["ranks"]
    # The timed-out job of the first run: its SIGABRT is the watchdog's too; the rank behind stays the culprit.
    v = analyze(REC / "torchrun.stderr.txt")
    assert v["root_cause"]["culprit"]["ranks"] == [1]
    assert not any(f["category"] == "rank_crashed" and f["culprit"]["ranks"] == [0] for f in v["findings"])


@pytest.mark.parametrize(
    "folder, category, ranks, live_category, live_ranks",
    [
        # rank 0 alone in evaluate()'s all-reduce (stacks-rank0: "evaluate (hung_job.py:48)"), rank 1 in step 6's;
        # ncclras-v.txt: "Rank 0 has launched up to operation 17", "Rank 1 ... 20".
        ("h100_eval_rank0", "conditional_collective", [0], "conditional_collective", [1]),
        # stacks-rank1: the worker's Shard.__getitem__ (hung_job.py:63) blocked in futex.
        ("h100_dataloader_worker", "dataloader_stall", [1], "dataloader_stall", [1]),
        # stacks-rank1: save_checkpoint (hung_job.py:89) in torch.save, processes: openat on a FIFO.
        ("h100_checkpoint_fifo", "io_stall", [1], "io_stall", [1]),
        # stacks-rank1: "barrier (torch/distributed/distributed_c10d.py:5030)" under train (hung_job.py:122);
        # nccl-rank1.log: "NET/Socket : peer 127.0.0.1<41724> message truncated".
        ("h100_uneven_barrier", "conditional_collective", [1], "collective_mismatch", [0]),
    ],
)
def test_recorded_gpu_hangs(folder, category, ranks, live_category, live_ranks):
    rec = REC.parent / folder
    live = json.loads((rec / "diagnose.json").read_text())
    assert (live["root_cause"]["category"], live["root_cause"]["culprit"]["ranks"]) == (
        live_category,
        live_ranks,
    )
    v = analyze(rec / "bundle")
    rc = v["root_cause"]
    assert (rc["category"], rc["culprit"]["ranks"]) == (category, ranks), rc
    assert v["status"] == "hung"


def test_nccl_message_truncated_is_no_socket_fault():
    # net_socket.cc: a peer sent more bytes than the matching receive posted; it returns ncclInvalidUsage.
    v = analyze(REC.parent / "h100_uneven_barrier" / "nccl.rank1.log")
    assert v["root_cause"]["category"] != "network_fault"
    assert not any(f["category"] == "network_fault" for f in v["findings"])


def test_pasted_native_dumps_take_their_ranks_from_nccl_ras():
    # What a user pastes: two bare `py-spy dump --native` (pids 522 and 523, no rank) and `ncclras -v`, whose
    # report names "Rank 1 ... process 523 on node 127.0.0.1". Rank 1 waits on a lock (PyThread_acquire_lock_timed
    # under log_metrics), rank 0 in cudaStreamSynchronize under at::native::item.
    v = analyze(REC / "pyspy-native.522.txt", REC / "pyspy-native.523.txt", REC / "ncclras-v.txt")
    rc = v["root_cause"]
    assert rc["category"] == "user_deadlock", rc
    assert rc["culprit"]["ranks"] == [1]
