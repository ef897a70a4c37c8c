"""Partial evidence weighed as an engineer weighs it (playbooks/signals.py, partial.py, exits.py, timeline.py).

Victims and survivors name no culprit by themselves; the order of events separates the first failure from the
teardown; a watchdog timeout's own fields (its value, op, size, sequence number) say more than "timed out";
GPUs at 100% on little power are spinning NCCL kernels; agreeing signals add up. The texts are the emitters'
own formats (PyTorch's ProcessGroupNCCL and torch elastic, NCCL's socket and proxy warnings, gloo, srun,
nvidia-smi), with made-up hosts, pids and times.
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths


def _verdict(tmp_path, text: str, name: str = "paste.txt"):
    p = tmp_path / name
    p.write_text(text)
    return engine.run(evidence_from_paths([str(p)]))


def _watchdog(
    rank: int, when: str, seq: int = 88, op: str = "ALLREDUCE", numel: int = 1, timeout_ms: int = 600000
):
    n_out = numel * 4 if op == "ALLGATHER" else numel
    return (
        f"[rank{rank}]:[E501 {when}.123456789 ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective "
        f"operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={n_out}, "
        f"Timeout(ms)={timeout_ms}) ran for {timeout_ms + 12} milliseconds before timing out.\n"
    )


def test_a_rank_that_died_before_the_timeouts_is_the_cause_and_the_rank_absent_from_them(tmp_path):
    text = (
        "[2024-05-01 10:00:03,120] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1) "
        "local_rank: 2 (pid: 4411) of binary: /usr/bin/python3\n"
        + "".join(_watchdog(r, "10:30:05", numel=1 << 20, timeout_ms=1800000) for r in (0, 1, 3))
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [2]
    assert "30 min before the first timeout" in rc.summary and "never reported waiting" in rc.summary
    assert rc.confidence >= 0.6  # two things agree: it died first, and it is the one that did not wait


def test_a_worker_aborted_after_the_timeouts_is_their_teardown_not_a_crash(tmp_path):
    text = (
        _watchdog(0, "10:30:05")
        + _watchdog(1, "10:30:05")
        + "W0501 10:30:09.150000 29471 torch/distributed/elastic/multiprocessing/api.py:897] Sending process "
        "29575 closing signal SIGTERM\n"
        "E0501 10:30:10.249000 29471 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -6) "
        "local_rank: 0 (pid: 29574) of binary: /usr/bin/python\n"
    )
    v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "unknown" and not rc.culprit.ranks
    assert "SIGABRT" in rc.summary and "synchronisation point" in rc.summary
    assert all(f.category != "rank_crashed" or f.confidence < rc.confidence for f in v.findings)


def test_sigabrt_alone_is_read_as_the_watchdogs_abort_and_says_how_to_tell(tmp_path):
    text = (
        "W1129 11:56:59.150000 29471 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 29574 "
        "closing signal SIGTERM\n"
        "E1129 11:57:07.249000 29471 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -6) "
        "local_rank: 3 (pid: 29577) of binary: /usr/bin/python\n"
    )
    v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "unknown" and "watchdog" in rc.summary
    assert any("Watchdog caught collective operation timeout" in s for s in rc.next_steps)
    crash = [f for f in v.findings if f.category == "rank_crashed"]
    assert crash and crash[0].culprit.ranks == [3] and crash[0].confidence < rc.confidence


def test_a_worker_killed_by_sigkill_is_still_a_crash(tmp_path):
    text = (
        "E1129 11:57:07.249000 29471 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -9) "
        "local_rank: 3 (pid: 29577) of binary: /usr/bin/python\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [3] and rc.confidence >= 0.8


def test_a_peer_that_closed_its_socket_before_the_timeout_is_the_one_that_died(tmp_path):
    text = (
        "nodeA:1234:1290 [0] NCCL WARN socketProgress: Connection closed by remote peer nodeB.cluster<45123>\n"
        "nodeA:1234:1290 [0] NCCL INFO misc/socket.cc:750 -> 6\n"
        "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL("
        "SeqNum=12, OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) ran for 600100 "
        "milliseconds before timing out.\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.hosts == ["nodeB.cluster"]
    assert "ncclRemoteError" in rc.summary


def test_a_peer_lost_after_the_timeout_is_the_teardown(tmp_path):
    text = (
        "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL("
        "SeqNum=12, OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) ran for 600100 "
        "milliseconds before timing out.\n"
        "[rank1]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
        "[10.0.0.7]:35411\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "unknown" and "teardown" in rc.summary


def test_a_broken_connection_is_a_lost_peer_not_a_set_up_failure(tmp_path):
    text = (
        "node-a:183006:183220 [1] misc/socket.cc:518 NCCL WARN Net : Call to recv from 10.200.84.247<58355> "
        "failed : Broken pipe\n"
        "node-a:183006:183220 [1] NCCL INFO misc/socket.cc:535 -> 6\n"
        "node-a:183006:183220 [1] proxy.cc:1119 NCCL WARN [Proxy Service 9] Failed to execute operation Connect "
        "from rank 9, retcode 6\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and "10.200.84.247" in rc.culprit.hosts
    assert "node-a" not in rc.culprit.hosts  # the survivor printed it


def test_a_refused_connection_is_still_a_set_up_failure(tmp_path):
    text = (
        "node-a:1234:1290 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.9<43521> failed"
        " : Software caused connection abort\n"
        "node-a:1234:1290 [0] misc/socket.cc:567 NCCL WARN socketConnect: Connect to 10.0.0.9<43521> failed : "
        "Connection refused\n"
        "node-a:1234:1290 [0] NCCL INFO bootstrap.cc:77 -> 2\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "comm_init_failure"


def test_a_short_timeout_on_a_sync_point_says_a_slow_rank_trips_it_and_how_to_tell(tmp_path):
    text = _watchdog(2, "22:46:25", seq=493, op="ALLGATHER", timeout_ms=60000) + _watchdog(
        3, "22:46:25", seq=493, op="ALLGATHER", timeout_ms=60000
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "unknown" and rc.confidence < 0.4
    assert "60 s, set by the job" in rc.summary and "synchronisation point" in rc.summary
    assert "ranks 0 and 1 of the group of 4" in rc.summary  # NumelOut = 4 x NumelIn: a group of four
    assert any("longer timeout" in s for s in rc.next_steps)
    assert any("py-spy dump" in s for s in rc.next_steps)


def test_a_timeout_on_the_first_collective_points_at_the_transport_too(tmp_path):
    text = _watchdog(0, "10:30:05", seq=1, op="ALLGATHER", timeout_ms=1800000)
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "unknown" and "first collective" in rc.summary
    assert any("all_reduce_perf" in s for s in rc.next_steps)


def test_a_default_timeout_on_a_big_op_stays_unknown(tmp_path):
    rc = _verdict(tmp_path, _watchdog(3, "04:35:53", seq=3348, op="BROADCAST", numel=54607872)).root_cause
    assert rc.category == "unknown" and "carries data" in rc.summary and "set by the job" not in rc.summary


_SMI = """\
+-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |
|===============================+======================+======================|
|   0  NVIDIA A100-SXM...  On   | 00000000:07:00.0 Off |                    0 |
| N/A   40C    P0   {p0}W / 400W |  24222MiB / 40536MiB |    100%      Default |
|                               |                      |             Disabled |
+-------------------------------+----------------------+----------------------+
|   1  NVIDIA A100-SXM...  On   | 00000000:0F:00.0 Off |                    0 |
| N/A   38C    P0   {p1}W / 400W |  20572MiB / 40536MiB |    100%      Default |
|                               |                      |             Disabled |
+-------------------------------+----------------------+----------------------+
"""


def test_gpus_at_full_utilisation_on_little_power_are_spinning_in_nccl(tmp_path):
    v = _verdict(tmp_path, _SMI.format(p0=" 92", p1=" 87"))
    rc = v.root_cause
    assert rc.category == "unknown" and rc.playbook == "gpus_spinning" and rc.confidence > 0.1
    assert "92 W of 400 W" in rc.summary and "spinning" in rc.summary
    assert any("nvidia-smi --query-gpu" in s for s in rc.next_steps)


def test_gpus_at_full_utilisation_on_full_power_are_computing(tmp_path):
    v = _verdict(tmp_path, _SMI.format(p0="301", p1="302"))
    assert all(f.playbook != "gpus_spinning" for f in v.findings)


def test_one_ranks_stack_in_a_collective_says_it_is_the_waiting_side(tmp_path):
    text = (
        "Process 7685: /usr/bin/python3 -u train.py\n"
        "Python v3.11.7 (/usr/bin/python3)\n\n"
        'Thread 7685 (idle): "MainThread"\n'
        "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n"
        "    wrapper (torch/distributed/c10d_logger.py:83)\n"
        "    train_step (train.py:42)\n"
        "    <module> (train.py:90)\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "unknown" and "the side that waits" in rc.summary
    assert any("every other rank" in s for s in rc.next_steps)


_IB_12 = (
    "node1:1200:1333 [0] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<47534> "
    "with error 12, opcode 0, len 0, vendor err 129 (Send) localGid ::ffff:10.0.0.1 remoteGid ::ffff:10.0.0.2\n"
)


def test_a_peer_that_stopped_answering_after_a_crash_stopped_because_of_it(tmp_path):
    text = (
        "[ 5000.000000] python[4242]: segfault at 0 ip 00007f1234567890 sp 00007ffc12345678 error 4 in "
        "libc.so.6[7f1234500000+195000]\n" + _IB_12
    )
    v = _verdict(tmp_path, text)
    assert v.root_cause.category == "rank_crashed" and "consequence" in v.root_cause.summary
    assert all(f.category != "network_fault" for f in v.findings)


def test_a_peer_that_stopped_answering_with_no_crash_is_the_fabric(tmp_path):
    assert _verdict(tmp_path, _IB_12).root_cause.category == "network_fault"


def test_a_flushed_completion_only_echoes_an_earlier_failure(tmp_path):
    text = (
        "[E ProcessGroupNCCL.cpp:852] [Rank 16] NCCL watchdog thread terminated with exception: NCCL error: remote "
        "process exited or there was a network error, NCCL version 2.19.3\n"
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.\n"
        "Last error:\n"
        "NET/IB : Got completion from peer 10.42.0.2<47534> with error 5, opcode 48, len 32764, vendor err 244\n"
    )
    v = _verdict(tmp_path, text)
    assert v.root_cause.category == "rank_crashed"
    assert all(f.category != "network_fault" for f in v.findings)


def test_connections_closed_at_a_normal_end_are_no_crash(tmp_path):
    text = (
        "node-1:185:1027 [7] NCCL INFO [Service thread] Connection closed by localRank 0\n"
        "node-1:180:1028 [2] NCCL INFO [Service thread] Connection closed by localRank 0\n"
    )
    v = _verdict(tmp_path, text)
    assert all(f.category != "rank_crashed" for f in v.findings)


def _smi_row(i: int, bus: str, power: int, mem: int, util: int) -> str:
    return (
        f"|   {i}  NVIDIA A100-SXM...  On   | 00000000:{bus}:00.0 Off |                    0 |\n"
        f"| N/A   40C    P0   {power:3d}W / 400W |  {mem:5d}MiB / 40536MiB |    {util:3d}%      Default |\n"
        "|                               |                      |             Disabled |\n"
        "+-------------------------------+----------------------+----------------------+\n"
    )


def test_an_idle_gpu_whose_process_left_while_its_memory_is_held_is_a_crash(tmp_path):
    rows = [
        (0, "07", 90, 30000, 100),
        (1, "0F", 88, 30010, 100),
        (2, "47", 61, 29000, 0),
        (3, "4E", 91, 30020, 100),
    ]
    text = "".join(_smi_row(*r) for r in rows) + (
        "| Processes:                                                                  |\n"
        "|  GPU   GI   CI        PID   Type   Process name                  GPU Memory |\n"
        "|=============================================================================|\n"
        "|    0   N/A  N/A     41001      C   python                          29990MiB |\n"
        "|    1   N/A  N/A     41002      C   python                          30000MiB |\n"
        "|    3   N/A  N/A     41004      C   python                          30010MiB |\n"
        "+-----------------------------------------------------------------------------+\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.gpus == ["0000:47:00.0"]
    assert "no process is listed on it" in rc.summary and "fraction of their power limit" in rc.summary


def test_only_nccls_trace_with_its_remote_error_points_at_the_peer_at_low_confidence(tmp_path):
    text = (
        "node1:1234:1290 [0] NCCL WARN Net : Connection closed by remote peer\n"
        "node1:1234:1290 [0] NCCL INFO misc/socket.cc:750 -> 6\n"
        "node1:1234:1290 [0] NCCL INFO transport/net_socket.cc:368 -> 6\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    # The WARN line has its own suggestive row (nccl.socket.connection_closed_legacy): no more than suggestive.
    assert rc.category == "rank_crashed" and rc.confidence <= 0.5 and not rc.culprit.hosts
    assert "ncclRemoteError" in rc.summary and "the peer that went away" in rc.fix


def test_two_causes_nearly_as_likely_are_each_less_sure_and_the_words_name_both():
    from hangdx.playbooks.engine import _close_call
    from hangdx.playbooks.verdict import Culprit, Finding

    top = Finding(
        "rank_exception", "rank_crashed", 0.7, "Rank 1 raised: ValueError.", Culprit(ranks=[1]), [], ""
    )
    second = Finding(
        "network_fault", "network_fault", 0.68, "Network fault on node-7: 1 NCCL IB error.", Culprit(), [], ""
    )
    findings = [top, second]
    _close_call(findings)
    assert (top.confidence, second.confidence) == (0.65, 0.63)
    assert "Nearly as likely" in top.summary and "network fault (Network fault on node-7" in top.summary
    far = Finding("network_fault", "network_fault", 0.5, "Network fault.", Culprit(), [], "")
    sure = Finding("rank_exception", "rank_crashed", 0.7, "Rank 1 raised.", Culprit(ranks=[1]), [], "")
    _close_call([sure, far])
    assert sure.confidence == 0.7 and "Nearly" not in sure.summary


def _pyspy(pid: int, frames: list[str]) -> str:
    """A `py-spy dump --pid PID` of one process, in py-spy's own format."""
    body = "".join(f"    {f}\n" for f in frames)
    return (
        f"Process {pid}: python train.py\nPython v3.10.12 (/usr/bin/python3.10)\n\n"
        f'Thread {pid} (idle): "MainThread"\n{body}\n'
    )


_STEP_ALLREDUCE = [
    "all_reduce (torch/distributed/distributed_c10d.py:2050)",
    "sync_flags (cache.py:196)",
    "check_prefetch (cache.py:1350)",
    "train_step (train.py:88)",
    "<module> (train.py:140)",
]
_NEXT_BROADCAST = [
    "broadcast (torch/distributed/distributed_c10d.py:1906)",
    "broadcast_object_list (torch/distributed/distributed_c10d.py:2680)",
    "receive_batch (train.py:61)",
    "train_step (train.py:80)",
    "<module> (train.py:140)",
]


def test_unranked_processes_in_collectives_called_from_different_places_diverged(tmp_path):
    text = _pyspy(4101, _STEP_ALLREDUCE) + "".join(_pyspy(pid, _NEXT_BROADCAST) for pid in (4102, 4103, 4104))
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "conditional_collective"
    assert rc.culprit.ranks == [] and rc.culprit.processes == ["pid 4101"]  # the one against three that agree


def test_two_unranked_processes_in_different_collectives_name_neither(tmp_path):
    text = _pyspy(4101, _STEP_ALLREDUCE) + _pyspy(4102, _NEXT_BROADCAST)
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "conditional_collective" and rc.culprit.processes == []


def test_unranked_processes_in_the_same_collective_are_not_a_divergence(tmp_path):
    text = "".join(_pyspy(pid, _NEXT_BROADCAST) for pid in (4101, 4102))
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category != "conditional_collective"
