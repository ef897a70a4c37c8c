"""Crash, GPU, fabric-init and storage texts in their emitters' own formats, as people paste them: what an
engineer concludes from each, hangdx must conclude too (issue 24: rules that generalise).

The texts are in the formats of the sources each rule cites (Open MPI opal/util/stacktrace.c, CUDA's error names
and strings, NCCL's NCCLCHECK back trace, PyTorch's ProcessGroupGloo warning, torch elastic's agent, DeepSpeed's
launcher, syslog through grep -H, procps ps); host names, pids and numbers are made up.
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths


def verdict(text: str):
    return engine.run(evidence_from_paths(["-"], stdin=text.encode())).root_cause


def test_open_mpis_fatal_signal_report_is_a_process_that_died():
    rc = verdict(
        "[gpu-node-07:41227] *** Process received signal ***\n"
        "[gpu-node-07:41227] Signal: Bus error (7)\n"
        "[gpu-node-07:41227] Signal code: Non-existant physical address (2)\n"
        "[gpu-node-07:41227] [ 0] /lib/x86_64-linux-gnu/libc.so.6(+0x42520)[0x7f3a1c442520]\n"
        "[gpu-node-07:41227] *** End of error message ***\n"
    )
    assert rc.category == "rank_crashed", rc.summary
    assert "Bus error" in rc.summary
    assert rc.culprit.hosts == ["gpu-node-07"]


def test_open_mpis_report_of_an_abort_after_a_collective_timeout_does_not_outweigh_the_timeout():
    rc = verdict(
        "[rank1]:[E1122 01:48:50.682679688 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 "
        "milliseconds before timing out.\n"
        "[gpu-node-07:41227] *** Process received signal ***\n"
        "[gpu-node-07:41227] Signal: Aborted (6)\n"
    )
    # The watchdog aborts the rank that waited: its abort is the timeout's consequence, not a crash to blame.
    assert rc.category != "rank_crashed", rc.summary


def test_cuda_driver_error_name_for_uncorrectable_ecc_is_a_gpu_fault_whoever_wraps_it():
    for text in (
        "call to cuMemAlloc returned error 214 (CUDA_ERROR_ECC_UNCORRECTABLE): uncorrectable ECC error encountered\n",
        "RuntimeError: cuda runtime error (39) : uncorrectable ECC error encountered at THCGeneral.cpp:50\n",
        "cupy_backends.cuda.api.runtime.CUDARuntimeError: cudaErrorECCUncorrectable: uncorrectable ECC error encountered\n",
    ):
        rc = verdict(text)
        assert rc.category == "gpu_fault", (text, rc.summary)


def test_uncorrectable_nvlink_error_is_a_gpu_fault():
    rc = verdict("call to cuStreamSynchronize returned error 220 (CUDA_ERROR_NVLINK_UNCORRECTABLE)\n")
    assert rc.category == "gpu_fault", rc.summary


def test_nccl_error_returned_through_bootstrap_is_a_communicator_set_up_failure():
    rc = verdict(
        "node-a:5120:5188 [1] NCCL INFO misc/socket.cc:484 -> 2\n"
        "node-a:5120:5188 [1] NCCL INFO bootstrap.cc:286 -> 2\n"
        "node-a:5120:5188 [1] NCCL INFO init.cc:1612 -> 2\n"
    )
    assert rc.category == "comm_init_failure", rc.summary
    assert "node-a" in rc.culprit.hosts


def test_an_nccl_back_trace_outside_bootstrap_names_no_init_failure():
    rc = verdict("node-a:5120:5188 [1] NCCL INFO enqueue.cc:1960 -> 5\n")
    assert rc.category != "comm_init_failure", rc.summary


def test_the_rank_that_fell_back_to_loopback_is_the_culprit_of_a_gloo_mesh_that_never_formed():
    rc = verdict(
        "[rank3] [W ProcessGroupGloo.cpp:715] Warning: Unable to resolve hostname to a (local) address. Using the "
        "loopback address as fallback. Manually set the network interface to bind to with GLOO_SOCKET_IFNAME.\n"
        "[rank3] RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144]"
        " no error\n"
        "[rank3] Gloo connectFullMesh failed ... timed out connecting: SO_ERROR: Connection refused, "
        "remote=[127.0.0.1]:29411\n"
    )
    assert rc.category == "comm_init_failure", rc.summary
    assert rc.culprit.ranks == [3], rc.summary
    assert "loopback" in rc.summary and "GLOO_SOCKET_IFNAME" in rc.fix


def test_syslog_through_grep_h_names_the_host_of_a_hung_task():
    rc = verdict(
        "/var/log/messages:Mar  2 04:11:52 trn-node-12 kernel: INFO: task python:88120 blocked for more than "
        "122 seconds.\n"
        '/var/log/messages:Mar  2 04:11:52 trn-node-12 kernel: "echo 0 > /proc/sys/kernel/hung_task_timeout_secs"'
        " disables this message.\n"
    )
    assert rc.category == "io_stall", rc.summary
    assert "trn-node-12" in rc.culprit.hosts


def test_a_ps_table_whose_header_a_filter_dropped_is_read_by_the_ps_command_above_it():
    rc = verdict(
        "$ ps -eo pid,stat,wchan:32,args | awk '$2 ~ /^D/'\n"
        " 4410 D    nfs_wait_bit_killable            python train.py --rank 0\n"
        " 4411 D    nfs_wait_bit_killable            python train.py --rank 1\n"
    )
    assert rc.category == "io_stall", rc.summary


def test_torch_elastic_local_rank_is_the_rank_when_nothing_shows_a_second_node():
    line = (
        "torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 2 "
        "(pid: 7311) of binary: /usr/bin/python3\n"
    )
    rc = verdict(line)
    assert rc.category == "rank_crashed", rc.summary
    assert rc.culprit.ranks == [2], rc.summary


def test_torch_elastic_local_rank_names_no_rank_when_the_log_shows_two_nodes():
    rc = verdict(
        "node-a: torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 2 "
        "(pid: 7311) of binary: /usr/bin/python3\n"
        "node-b: torch.distributed.elastic.multiprocessing.api: [WARNING] Sending process 7400 closing signal "
        "SIGTERM\n"
    )
    assert rc.category == "rank_crashed", rc.summary
    assert rc.culprit.ranks == [], rc.summary


def test_deepspeed_launcher_exit_pasted_wrapped_is_still_a_rank_that_died():
    rc = verdict(
        "[2024-02-01 09:00:01,100] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 5001\n"
        "[2024-02-01 09:00:02,200] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python3', '-u', 'train.py', \n"
        "'--local_rank=3', '--deepspeed_config', 'ds.json'\n"
        "] exits with return code = -9\n"
    )
    assert rc.category == "rank_crashed", rc.summary
    # The command printed is the last one the launcher spawned, not the failed one's: no rank.
    assert rc.culprit.ranks == [], rc.summary


HUNG_NFS = """\
[ 9876.543210] INFO: task python:4242 blocked for more than 120 seconds.
[ 9876.543220]       Tainted: P           OE     5.15.0-91-generic #101-Ubuntu
[ 9876.543230] "echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.
[ 9876.543240] task:python          state:D stack:    0 pid: 4242 ppid:  4200 flags:0x00004002
[ 9876.543250] Call Trace:
[ 9876.543260]  <TASK>
[ 9876.543270]  __schedule+0x24e/0x590
[ 9876.543280]  schedule+0x69/0x110
[ 9876.543290]  io_schedule+0x46/0x80
[ 9876.543300]  nfs_wait_bit_killable+0x1f/0x80 [nfs]
[ 9876.543310]  nfs_file_flush+0x46/0x60 [nfs]
"""


def test_a_hung_task_whose_call_trace_is_in_a_file_system_is_an_io_stall_naming_it():
    rc = verdict(HUNG_NFS)
    assert rc.category == "io_stall", rc.summary
    assert rc.playbook == "hung_task_storage"
    assert "nfs_wait_bit_killable [nfs]" in rc.summary
    assert "pid 4242 (python)" in rc.culprit.processes


def test_a_hung_task_in_a_gpu_driver_call_is_not_called_storage():
    text = HUNG_NFS.replace(
        "nfs_wait_bit_killable+0x1f/0x80 [nfs]", "_nv012345rm+0x1f/0x80 [nvidia]"
    ).replace("nfs_file_flush+0x46/0x60 [nfs]", "nvidia_ioctl+0x46/0x60 [nvidia]")
    rc = verdict(text)
    assert rc.playbook != "hung_task_storage", rc.summary


def test_zfs_transaction_group_waits_in_a_ps_table_are_storage():
    rc = verdict(
        "# ps -eo pid,stat,wchan:32,comm | grep ' D'\n"
        " 2770 D    txg_wait_synced                  python\n"
        " 2771 D    txg_wait_open                    python\n"
    )
    assert rc.category == "io_stall", rc.summary


def test_nccl_2_1_lines_without_the_nccl_word_are_nccl_lines():
    """NCCL 2.0-2.2 printed `host:pid:tid [dev] file:line WARN msg` and `host:pid:tid [dev] INFO msg`."""
    from hangdx.probes.nccl_log import match_line

    warn = match_line(
        "node1:54573:54696 [1] include/socket.h:194 WARN Call to recv failed : Connection reset by peer"
    )
    assert (
        warn is not None
        and warn.level == "WARN"
        and warn.pid == 54573
        and warn.msg.startswith("Call to recv")
    )
    info = match_line("node1:54573:54696 [1] INFO transport/net_ib.cu:537 -> 2")
    assert info is not None and info.level == "INFO" and info.msg == "transport/net_ib.cu:537 -> 2"
    assert match_line("2024-01-02 10:00:01 INFO starting epoch 3") is None
