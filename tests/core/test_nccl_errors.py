"""What NCCL's own words settle without ranks: set-up failures, socket faults on the data path, p2p waits,
and watchdog SeqNums compared only within one process group.

Every text below is quoted from a public report (the same lines as tests/fixtures/real/ where a case is named):
NVIDIA/nccl #1837, #210, #706, #193, #584, #783, marin-community/marin #7018, NVIDIA/nccl-tests #166
(a socket failure inside communicator init), pytorch/pytorch #118369 (watchdog timeouts of several groups).
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source


def verdict(text: str):
    ev = Evidence()
    reader.read_text([text.encode()], Source("paste.log"), ev)
    return engine.run(ev), ev


def categories(v) -> set[str]:
    return {f.category for f in v.findings}


# -- set-up failures ------------------------------------------------------------------------------------------

IFNAME_1837 = """\
[trainer3]:twshared1016:1958:1958 [3] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth2
[trainer0|0]:ncclInternalError: Internal check failed.
[trainer0|0]:Last error:
[trainer0|0]:ncclSocketInit: connecting to address  with family 59936 is neither AF_INET(2) nor AF_INET6(10)
"""


def test_an_internal_error_from_socket_init_is_a_set_up_failure_pointing_at_the_forced_interface():
    v, ev = verdict(IFNAME_1837)
    (err,) = ev.events_of("nccl_error")
    assert err.fields["code"] == "ncclInternalError"
    assert err.fields["stage"] == "init"
    assert err.fields["last_error"].startswith("ncclSocketInit: connecting to address")
    rc = v.root_cause
    assert rc.category == "comm_init_failure"
    assert "NCCL_SOCKET_IFNAME=eth2" in rc.fix
    assert any("ncclSocketInit" in q.text for q in rc.evidence)  # the cause is quoted, verbatim
    assert any("set by environment to eth2" in q.text for q in rc.evidence)


def test_xla_comm_init_failure_with_no_socket_interface_is_a_set_up_failure():
    text = (
        "Failed to create NCCL communicator: INTERNAL: ncclCommInitRankConfig(...) failed:\n"
        "invalid usage ... Last NCCL warning(error): 'Bootstrap : no socket interface found'\n"
    )
    v, ev = verdict(text)
    (err,) = ev.events_of("nccl_error")
    assert err.fields["function"] == "ncclCommInitRankConfig"
    assert err.fields["code"] == "ncclInvalidUsage"
    assert err.fields["last_error"] == "Bootstrap : no socket interface found"
    assert v.root_cause.category == "comm_init_failure"
    assert "NCCL_SOCKET_IFNAME" in v.root_cause.fix


def test_an_nccl2_warning_without_the_word_nccl_is_read():
    v, ev = verdict(
        "include/socket.h:344 WARN Socket creation failed : Address family not supported by protocol\n"
    )
    assert ev.events_of("nccl_warn")[0].fields["stage"] == "init"
    assert v.root_cause.category == "comm_init_failure"


def test_a_socket_failure_whose_trace_runs_through_init_is_a_set_up_failure():
    text = """\
ubuntu:39964:40044 [0] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by remote peer node1<57557>
ubuntu:39964:40044 [0] NCCL INFO misc/socket.cc:749 -> 6
ubuntu:39964:40044 [0] NCCL INFO transport/net.cc:288 -> 3
ubuntu:39964:40044 [0] NCCL INFO init.cc:1089 -> 3
"""
    v, ev = verdict(text)
    assert ev.events_of("nccl_conn_refused")[0].fields["stage"] == "init"
    assert v.root_cause.category == "comm_init_failure"
    assert "network_fault" not in categories(v)


# -- the data path ---------------------------------------------------------------------------------------------

RECV_706 = """\
[15]worker-23:83:2526 [0] misc/socket.cc:503 NCCL WARN Net : Call to recv from 100.96.188.199<41468> failed : Connection timed out
[15]worker-23:83:2526 [0] NCCL INFO misc/socket.cc:520 -> 2
[15]23:83:2526 [0] transport/net_socket.cc:219 NCCL WARN NET/Socket : socket progress error
[15]worker-23:83:2520 [0] NCCL INFO include/net.h:32 -> 2
[15]worker-23:83:2520 [0] NCCL INFO transport/net.cc:870 -> 2
[15]worker-23:83:2520 [0] NCCL INFO proxy.cc:494 -> 2
[15]worker-23:83:2520 [0] NCCL INFO proxy.cc:614 -> 2 [Proxy Thread]
"""


def test_a_recv_that_fails_in_the_proxy_thread_is_a_network_fault_not_a_set_up_failure():
    v, ev = verdict(RECV_706)
    assert {e.fields.get("stage") for e in ev.events_of("nccl_conn_refused", "nccl_warn")} == {"data"}
    rc = v.root_cause
    assert rc.category == "network_fault"
    # `23` is a cut prefix, not a host; the peer the receive timed out on is the link's other end.
    assert rc.culprit.hosts == ["100.96.188.199", "worker-23"]
    assert "100.96.188.199" in rc.summary
    assert "comm_init_failure" not in categories(v)


def test_nccl_2_3_socket_errors_in_the_proxy_thread_are_a_network_fault():
    text = """\
worker0-0d9gnb:15:91 [3] include/socket.h 398 NCCL WARN Call to write failed : Connection reset by peer.
worker0-0d9gnb:15:91 [3] transport.cu:153 NCCL WARN transport.cu:153 ->2 [Proxy thread error]
"""
    v, ev = verdict(text)
    (e,) = ev.events_of("nccl_conn_refused")
    assert e.fields["error"] == "Connection reset by peer" and e.fields["stage"] == "data"
    assert v.root_cause.category == "network_fault"


def test_a_failed_connect_with_no_stage_named_is_still_a_set_up_failure():
    text = (
        "node1:1:2 [0] misc/socket.cc:483 NCCL WARN socketStartConnect: Connect to 10.0.0.2<45763> "
        "failed : Software caused connection abort\n"
    )
    v, ev = verdict(text)
    assert "stage" not in ev.events_of("nccl_conn_refused")[0].fields
    assert v.root_cause.category == "comm_init_failure"


# -- point-to-point ---------------------------------------------------------------------------------------------

SENDS_783 = """\
[0] NCCL INFO Send: opCount 1 sendbuff (nil) recvbuff 0x7fbfbe7a4f40 count 1572864 datatype 7 op 0 root 1 comm 0x5574e8f68900 [nranks=2] stream 0x5574b87450d0
[0] NCCL INFO Send: opCount 2 sendbuff (nil) recvbuff 0x7fbfc09b1040 count 1572864 datatype 7 op 0 root 1 comm 0x5574e8f68900 [nranks=2] stream 0x5574b87450d0
"""
P2P_584 = """\
ubuntu:199574:201142 [1] NCCL INFO Recv: opCount da0 sendbuff (nil) recvbuff 0x7f526c000000 count 2420736 datatype 7 op 0 root 0 comm 0x7f516c002e10 [nranks=2] stream 0x55f1de7279a0
ubuntu:199574:201142 [1] NCCL INFO Send: opCount d98 sendbuff 0x7f526f13c000 recvbuff (nil) count 2420736 datatype 7 op 0 root 1 comm 0x7f5128002e10 [nranks=2] stream 0x55f1de727ae0
ubuntu:199574:201142 [1] NCCL INFO Send: opCount d9a sendbuff 0x7f526fa78000 recvbuff (nil) count 2420736 datatype 7 op 0 root 1 comm 0x7f5128002e10 [nranks=2] stream 0x55f1de727ae0
"""


def test_lines_without_host_pid_tid_are_read_and_sends_to_the_peer_are_a_p2p_wait_between_both_ranks():
    v, ev = verdict(SENDS_783)
    assert [c.op for c in ev.collectives] == ["send", "send"]
    assert all(c.device == 0 for c in ev.collectives)
    rc = v.root_cause
    assert rc.category == "p2p_deadlock"
    assert rc.culprit.ranks == [0, 1]  # a 2-rank communicator: the sender is 0, `root 1` the peer


def test_p2p_calls_over_two_communicators_name_the_process_not_ranks():
    v, _ = verdict(P2P_584)
    rc = v.root_cause
    assert rc.category == "p2p_deadlock"
    assert rc.culprit.ranks == []  # rank 1 in one communicator, rank 0 in the other: not job ranks
    assert rc.culprit.processes == ["ubuntu pid 199574 cudaDev 1"]


def test_two_ranks_sending_to_each_other_are_surer():
    other = (
        SENDS_783.replace("[0] NCCL", "[1] NCCL").replace("root 1", "root 0").replace("0x5574e8f68900", "0x1")
    )
    v, _ = verdict(SENDS_783 + other)
    assert v.root_cause.category == "p2p_deadlock"
    assert v.root_cause.confidence >= 0.8


def test_a_process_whose_last_call_is_a_collective_is_no_p2p_wait():
    allreduce = (
        "ubuntu:199574:201142 [1] NCCL INFO AllReduce: opCount da4 sendbuff 0x7f526c000000 recvbuff 0x7f526c000000 "
        "count 2420736 datatype 7 op 0 root 0 comm 0x7f516c002e10 [nranks=2] stream 0x55f1de7279a0\n"
    )
    v, _ = verdict(P2P_584 + allreduce)
    assert "p2p_deadlock" not in categories(v)


# -- watchdog SeqNums across process groups --------------------------------------------------------------------


def _timeout(rank: int, seq: int, pg: str = "") -> str:
    return (
        f"[E ProcessGroupNCCL.cpp:458] [{pg}Rank {rank}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25625613 milliseconds before timing out.\n"
    )


def test_seqnums_of_unnamed_groups_are_not_compared_across_ranks():
    text = _timeout(0, 96117) + _timeout(0, 96120) + _timeout(0, 96125) + _timeout(7, 64088)
    v, _ = verdict(text)
    assert "conditional_collective" not in categories(v)
    assert v.root_cause.category == "unknown"


def test_one_seqnum_per_rank_is_still_compared():
    v, _ = verdict(_timeout(0, 120) + _timeout(1, 120) + _timeout(2, 119))
    assert v.root_cause.category == "conditional_collective"
    assert v.root_cause.culprit.ranks == [2]


def test_named_groups_are_compared_within_one_group():
    text = (
        _timeout(0, 50, "PG 0 ")
        + _timeout(1, 50, "PG 0 ")
        + _timeout(2, 48, "PG 0 ")
        + _timeout(0, 9000, "PG 3 ")  # another group's numbers: never compared with PG 0's
    )
    v, _ = verdict(text)
    assert v.root_cause.category == "conditional_collective"
    assert v.root_cause.culprit.ranks == [2]


def test_a_long_log_without_host_pid_tid_keeps_each_devices_last_calls():
    """The reader keeps only each process's last collective lines of a huge log; `[dev]` names the process."""
    line = SENDS_783.splitlines()[0]
    lines = [line.replace("opCount 1 ", f"opCount {i:x} ") for i in range(1, 30_001)]
    v, ev = verdict("\n".join(lines) + "\n")
    assert max(int(c.quote.line) for c in ev.collectives) == 30_000
    assert v.root_cause.category == "p2p_deadlock"


# -- an interface other nodes cannot reach, in a set-up that never finished ------------------------------------

# pytorch/pytorch #68893 (rank 0's NCCL_DEBUG=INFO output; the reporter's fix was NCCL_SOCKET_IFNAME=ens5).
VETH_68893 = """\
ip-172-31-0-137:14605:14673 [0] NCCL INFO Bootstrap : Using [0]ens5:172.31.0.137<0> [1]veth75fa783:fe80::14ad:64ff:fe64:b31e%veth75fa783<0>
ip-172-31-0-137:14605:14673 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]
ip-172-31-0-137:14605:14673 [0] NCCL INFO NET/Socket : Using [0]ens5:172.31.0.137<0> [1]veth75fa783:fe80::14ad:64ff:fe64:b31e%veth75fa783<0>
ip-172-31-0-137:14605:14673 [0] NCCL INFO Using network Socket
NCCL version 2.7.8+cuda11.1
ip-172-31-0-137:14605:14688 [0] NCCL INFO Channel 00/04 :    0   1
ip-172-31-0-137:14605:14688 [0] NCCL INFO Channel 00 : 1[1e0] -> 0[1e0] [receive] via NET/Socket/0
"""


def test_a_container_interface_in_a_set_up_that_never_finished_is_a_set_up_failure_on_that_interface():
    v, _ = verdict(VETH_68893)
    rc = v.root_cause
    assert rc.category == "comm_init_failure"
    assert rc.culprit.hosts == ["ip-172-31-0-137"]
    assert "veth75fa783" in rc.summary
    assert "NCCL_SOCKET_IFNAME" in rc.fix
    assert rc.confidence < 0.7  # the interface is a suspect: nothing says set-up failed


def test_the_same_interface_after_set_up_finished_is_not_blamed():
    # NCCL's own line when the communicator is up (init.cc's format): the interface did not stop set-up.
    done = "ip-172-31-0-137:14605:14605 [0] NCCL INFO comm 0x7f3c5c002f00 rank 0 nranks 2 cudaDev 0 busId 1e0 - Init COMPLETE\n"
    v, _ = verdict(VETH_68893 + done)
    assert "nccl_unroutable_interface" not in {f.playbook for f in v.findings}


def test_a_routable_interface_alone_is_not_blamed():
    text = "\n".join(ln for ln in VETH_68893.splitlines() if "Using [0]" not in ln)
    text += "\nip-172-31-0-137:14605:14673 [0] NCCL INFO NET/Socket : Using [0]ens5:172.31.0.137<0>\n"
    v, _ = verdict(text)
    assert "nccl_unroutable_interface" not in {f.playbook for f in v.findings}


# -- NCCL's own error trace through its set-up code -----------------------------------------------------------

# NVIDIA/nccl #582 (device 10's init thread; the others waited in bootstrapAllGather).
OOM_582 = """\
[10] ./third_party/gpus/nccl/src/include/alloc.h:58 NCCL WARN Cuda failure 'out of memory'
[10] NCCL INFO third_party/gpus/nccl/src/transport/p2p.cc:164 -> 1
[10] NCCL INFO third_party/gpus/nccl/src/transport.cc:34 -> 1
[10] NCCL INFO third_party/gpus/nccl/src/transport.cc:90 -> 1
[10] NCCL INFO third_party/gpus/nccl/src/init.cc:792 -> 1
[10] NCCL INFO third_party/gpus/nccl/src/init.cc:907 -> 1
"""


def test_an_error_whose_trace_runs_through_init_is_a_set_up_failure_and_an_oom_is_no_gpu_fault():
    v, _ = verdict(OOM_582)
    rc = v.root_cause
    assert rc.category == "comm_init_failure"
    assert rc.confidence >= 0.8
    assert "out of memory" in rc.summary
    assert "gpu_fault" not in categories(v)  # NCCL's cudaMalloc found the memory taken: not a hardware fault
    # The same trace with no prefix at all (as NVIDIA/nccl #976 pastes its lines): the catalogue's trace rows read it.
    bare = "\n".join(ln.removeprefix("[10] ") for ln in OOM_582.splitlines()) + "\n"
    v, _ = verdict(bare)
    assert v.root_cause.category == "comm_init_failure" and "init.cc" in v.root_cause.summary
    v, _ = verdict(OOM_582.splitlines()[0] + "\n")  # the WARN alone: set-up, by what NCCL allocates and when
    assert v.root_cause.category == "comm_init_failure"


def test_a_trace_through_net_ibs_own_init_or_the_data_path_is_not_set_up():
    for files in (("transport/net_ib/init.cc:301",), ("transport/net.cc:1040", "proxy.cc:1234")):
        text = (
            "node1:1:2 [0] transport/net_ib.cc:1296 NCCL WARN NET/IB : Got completion with error 12\n"
            + "".join(f"node1:1:2 [0] NCCL INFO {f} -> 6\n" for f in files)
        )
        v, _ = verdict(text)
        assert "nccl_trace_in_setup" not in {f.playbook for f in v.findings}


def test_a_cuda_failure_in_set_up_that_is_not_memory_stays_the_gpus():
    # NVIDIA/nccl #976: NVLS multicast set-up refused by a broken NVSwitch fabric, the trace through init.cc.
    text = (
        "transport/nvls.cc:165 NCCL WARN Cuda failure 'invalid argument'\n"
        "NCCL INFO transport/nvls.cc:324 -> 1\nNCCL INFO init.cc:1093 -> 1\nNCCL INFO init.cc:1358 -> 1\n"
    )
    v, _ = verdict(text)
    assert v.root_cause.category == "gpu_fault"


def test_watchdog_timeouts_at_one_seqnum_with_different_sizes_are_a_mismatch_not_a_rank_behind():
    # modelscope/ms-swift #10183: the same BROADCAST #7219 with 64 elements on rank 3 and 24,084,544 on rank 2;
    # rank 3 had enqueued #7220 (its program went on), which is no sign of rank 2 lagging.
    text = (
        "[rank3]:[E918 19:29:24.436955737 ProcessGroupNCCL.cpp:689] [Rank 3] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=7219, OpType=BROADCAST, NumelIn=64, NumelOut=64, Timeout(ms)=3000000) ran for "
        "3000097 milliseconds before timing out.\n"
        "[rank3]:[E918 19:29:24.440481846 ProcessGroupNCCL.cpp:2303] [PG ID 0 PG GUID 0(default_pg) Rank 3]  failure "
        "detected by watchdog at work sequence id: 7219 PG status: last enqueued work: 7220, last completed work: 7218\n"
        "[rank2]:[E918 19:29:25.950601628 ProcessGroupNCCL.cpp:689] [Rank 2] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=7219, OpType=BROADCAST, NumelIn=24084544, NumelOut=24084544, Timeout(ms)=3000000) "
        "ran for 3000074 milliseconds before timing out.\n"
        "[rank2]:[E918 19:29:25.950900997 ProcessGroupNCCL.cpp:2303] [PG ID 0 PG GUID 0(default_pg) Rank 2]  failure "
        "detected by watchdog at work sequence id: 7219 PG status: last enqueued work: 7219, last completed work: 7218\n"
    )
    v, _ = verdict(text)
    rc = v.root_cause
    assert rc.category == "collective_mismatch"
    assert rc.culprit.ranks == []  # two ranks, two sizes: which one diverged, the text cannot say
    assert "24,084,544" in rc.summary


def test_an_all_to_all_with_uneven_splits_is_no_mismatch():
    line = (
        "[rank{r}]:[E918 19:29:24.436955737 ProcessGroupNCCL.cpp:689] [Rank {r}] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=12, OpType=ALLTOALL_BASE, NumelIn={n}, NumelOut={n}, "
        "Timeout(ms)=600000) ran for 600097 milliseconds before timing out.\n"
    )
    v, _ = verdict(line.format(r=0, n=100) + line.format(r=1, n=160))
    assert v.root_cause.category != "collective_mismatch"


def test_only_the_trace_through_init_counts_not_an_earlier_one_of_the_data_path():
    text = (
        "node1:1:2 [0] transport/net_ib.cc:1296 NCCL WARN NET/IB : Got completion with error 12\n"
        "node1:1:2 [0] NCCL INFO transport/net.cc:1040 -> 6\nnode1:1:2 [0] NCCL INFO proxy.cc:1234 -> 6\n"
        + "\n" * 20
        + "\n".join(ln.removeprefix("[10] ") for ln in OOM_582.splitlines())
        + "\n"
    )
    v, _ = verdict(text)
    f = next(f for f in v.findings if f.playbook == "nccl_trace_in_setup")
    assert "out of memory" in f.summary and "Got completion" not in f.summary


# -- NVLS set-up: the fabric, not the set-up ---------------------------------------------------------------------

# NVIDIA/nccl#1488 (tests/fixtures/real/gpu_fault__NVIDIA-nccl-1488.log): NVLS multicast failing during
# communicator init on a node whose Fabric Manager had been restarted without a GPU reset.
NVLS_1488 = """\
node23:12098:12141 [2] transport/nvls.cc:244 NCCL WARN Cuda failure 1 'invalid argument'
node23:12098:12141 [2] NCCL INFO transport/nvls.cc:394 -> 1
node23:12098:12141 [2] NCCL INFO init.cc:1196 -> 1
node23:12098:12141 [2] NCCL INFO init.cc:1462 -> 1
node23:12098:12141 [2] NCCL INFO group.cc:75 -> 1 [Async thread]
"""


def test_a_cuda_failure_in_nvls_set_up_is_the_fabric_not_the_set_up():
    v, _ = verdict(NVLS_1488)
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.hosts == ["node23"]
    assert "nvidia-fabricmanager" in rc.fix and "NCCL_NVLS_ENABLE=0" in rc.fix
    assert any("fabric" in s for s in rc.next_steps)


def test_out_of_memory_in_nvls_set_up_stays_a_set_up_failure():
    # cuMemCreate of the multicast buffers failing for want of memory: NCCL's buffers, read by the OOM row.
    v, _ = verdict(NVLS_1488.replace("Cuda failure 1 'invalid argument'", "Cuda failure 2 'out of memory'"))
    assert v.root_cause.category == "comm_init_failure"
