"""How the playbooks weigh what a catalogue row says (probes/catalogue/*.yaml, playbooks/facts.py `row_vote`).

A row's strength is the emitter's source read: where a kind triggers a playbook, a decisive row settles, a
suggestive one points, a context row (or a row of another category) does not vote. A row's fields say who the line
is about: a list of ranks, the peer at the other end of a failed link (both ends suspect), the rank at the other end
of a failed connection, the node a scheduler names. Each test is written in the emitter's own format with made-up
hosts, pids and times, beside a near miss that must not read the same.
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.playbooks.facts import row_vote, votes
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.model import LogEvent, Quote


def _verdict(tmp_path, text: str, name: str = "paste.txt"):
    p = tmp_path / name
    p.write_text(text)
    return engine.run(evidence_from_paths([str(p)]))


def _xid(n: int, tail: str = "pid=48213, name=python, Ch 00000008") -> str:
    return f"[Mon May  1 10:22:13 2024] NVRM: Xid (PCI:0000:3b:00): {n}, {tail}\n"


# -- strength where a kind triggers a playbook ------------------------------------------------------------------


def test_an_xid_nvidia_files_for_a_reset_is_a_gpu_fault_at_the_decisive_weight(tmp_path):
    rc = _verdict(tmp_path, _xid(46)).root_cause  # nverror.h: GPU stopped processing, reset the GPU
    assert rc.category == "gpu_fault" and rc.confidence >= 0.9


def test_a_suggestive_xid_points_at_the_gpu_below_a_decisive_one(tmp_path):
    rc = _verdict(tmp_path, _xid(61, "pid=48213, name=python, 0cc7(1c68)")).root_cause
    assert rc.category == "gpu_fault" and 0.6 <= rc.confidence < 0.9


def test_an_application_xid_points_at_the_gpu_below_a_hardware_one_and_says_the_code_comes_first(tmp_path):
    # Xid 13: a kernel's out-of-range access, NVIDIA's catalog files it under the application; the contract counts
    # Xid errors as gpu_fault. Alone it points there, below a reset-or-service Xid, and never asks for a drain first.
    v = _verdict(
        tmp_path, _xid(13, "pid=48213, name=python, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)")
    )
    rc = v.root_cause
    assert rc.category == "gpu_fault" and 0.6 <= rc.confidence < 0.9
    assert "application" in rc.fix and "Restart the job without that node" not in rc.fix
    assert not any(s.startswith("Drain") for s in rc.next_steps)


def test_a_consequence_xid_names_no_gpu_fault(tmp_path):
    # Xid 45: the driver cleaning up the channels of a process that was killed or faulted before: a consequence.
    v = _verdict(tmp_path, _xid(45, "pid=48213, name=python, Ch 00000010"))
    assert all(f.category != "gpu_fault" for f in v.findings)


def test_a_lustre_connection_restored_is_no_storage_stall_but_a_lost_one_is(tmp_path):
    restored = "Lustre: scratch-OST0007-osc-ffff9d6153c91000: Connection restored to scratch-OST0007 (at 10.9.1.5@o2ib)\n"
    v = _verdict(tmp_path, restored)
    assert all(f.category != "io_stall" for f in v.findings)
    lost = (
        "Lustre: scratch-OST0007-osc-ffff9d6153c91000: Connection to scratch-OST0007 (at 10.9.1.5@o2ib) was lost; "
        "in progress operations using this service will wait for recovery to complete\n"
    )
    assert _verdict(tmp_path, lost, "lost.txt").root_cause.category == "io_stall"


def _ib(status: str) -> str:
    return (
        f"gpu-node-11:20311:20402 [4] transport/net_ib/p2p.cc:550 NCCL WARN NET/IB: Got completion from peer "
        f"10.20.0.31<52311> with status={status} opcode=IBV_WC_RECV(128) vendor_err=129  hca mlx5_4\n"
    )


def test_an_ib_retry_exceeded_names_both_ends_of_the_link(tmp_path):
    rc = _verdict(tmp_path, _ib("IBV_WC_RETRY_EXC_ERR(12)")).root_cause
    assert rc.category == "network_fault" and set(rc.culprit.hosts) == {"gpu-node-11", "10.20.0.31"}


def test_an_ib_flush_only_echoes_an_earlier_error(tmp_path):
    # IBV_WC_WR_FLUSH_ERR: the queue pair had already failed; a consequence, never the first failure.
    v = _verdict(tmp_path, _ib("IBV_WC_WR_FLUSH_ERR(5)"))
    assert all(f.category != "network_fault" for f in v.findings)


def test_an_ib_status_without_a_row_of_its_own_is_a_suggestive_network_fault(tmp_path):
    rc = _verdict(tmp_path, _ib("IBV_WC_GENERAL_ERR(21)")).root_cause
    assert rc.category == "network_fault" and rc.confidence < 0.84


# -- who a row's fields name ---------------------------------------------------------------------------------------


def test_a_straggler_detectors_list_of_ranks_is_the_culprit_not_the_rank_that_printed_it(tmp_path):
    text = "[rank0]: STRAGGLER DETECTION WARNING: Some GPUs have worse relative performance. Affected ranks: {3, 12}\n"
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.ranks == [3, 12]


def test_megatrons_bottom_ranks_are_read_from_their_value_rank_pairs(tmp_path):
    text = " ^^^^ Bottom 3 Ranks with lowest  Etpt(TF): 201.10/5, 355.40/9, 360.02/2,\n"
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.ranks == [2, 5, 9]


def test_the_ranks_that_never_called_ray_train_report_are_the_absent_ones(tmp_path):
    text = (
        "ray.train.v2._internal.exceptions.BroadcastCollectiveTimeoutError: The broadcast operation timed out "
        "after 1800.00 seconds. Please make sure all worker ranks call `ray.train.report`. \n"
        "The following ranks have not called it: [1, 6]\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "conditional_collective" and rc.culprit.ranks == [1, 6]


def test_mpich_names_the_peer_rank_not_the_rank_that_printed_the_stack(tmp_path):
    text = "[1,2]<stderr>:MPIDI_CH3I_Progress(...): Communication error with rank 3\n"
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [3]


def test_openib_retry_exceeded_and_hydras_connect_failure_name_both_hosts(tmp_path):
    text = (
        "[[31705,1],7][btl_openib_component.c:2951:handle_wc] from hpc-c01n02 to: hpc-c01n05 error polling LP CQ "
        "with status RETRY EXCEEDED ERROR status number 12 for wr_id 294230912 opcode 1  vendor error 129 qp_idx 1\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "network_fault" and set(rc.culprit.hosts) == {"hpc-c01n02", "hpc-c01n05"}
    text = (
        '[proxy:0:1@gpu-node-12] HYDU_sock_connect (utils/sock/sock.c:145): unable to connect from "gpu-node-12" '
        'to "gpu-node-14" (No route to host)\n'
    )
    rc = _verdict(tmp_path, text, "hydra.txt").root_cause
    assert rc.category == "comm_init_failure" and {"gpu-node-12", "gpu-node-14"} <= set(rc.culprit.hosts)


def test_rays_dead_node_is_the_culprit_not_the_driver_that_reported_it(tmp_path):
    text = (
        "2023-02-15 16:53:52,096\tWARNING worker.py:1462 -- The node with node id: 8f205b12643d25d8 and ip: "
        "10.4.0.21 has been marked dead because the detector has missed too many heartbeats from it. This can happen "
        "when a raylet crashes unexpectedly or has lagging heartbeats.\n"
        "(BackendExecutor pid=5126, ip=10.4.0.9) 2023-02-15 16:53:52,097\tERROR utils.py:42 -- The actor died "
        "unexpectedly before finishing this task.\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.hosts == ["10.4.0.21"]


def test_rays_memory_monitor_report_names_the_node_whose_workers_it_killed(tmp_path):
    text = (
        "(raylet) [2025-04-02 15:02:00,117 E 135782 135782] (raylet) node_manager.cc:3069: 2 Workers (tasks / "
        "actors) killed due to memory pressure (OOM), 0 Workers crashed due to other reasons at node (ID: "
        "351e406b196f66bb45eaad02a3b8b4725babfa8c, IP: 10.7.3.44) over the last time period.\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.confidence >= 0.8 and rc.culprit.hosts == ["10.7.3.44"]
    near = text.replace("2 Workers (tasks", "0 Workers (tasks").replace(
        "0 Workers crashed", "1 Workers crashed"
    )
    rc = _verdict(tmp_path, near, "near.txt").root_cause
    assert rc.category == "rank_crashed" and rc.confidence < 0.8  # crashed for another reason: it points


def test_slurmstepds_banner_names_its_own_node_where_its_oom_report_does_not(tmp_path):
    text = (
        "slurmstepd: error: *** JOB 5512345 ON gpu-b17 CANCELLED AT 2025-03-01T01:14:01 ***\n"
        "slurmstepd: error: Detected 1 oom_kill event in StepId=5512345.batch. Some of the step tasks have been OOM "
        "Killed.\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.hosts == ["gpu-b17"]


def test_a_closed_nccl_socket_without_its_peer_does_not_take_the_next_line_as_one(tmp_path):
    # ncclSocketToString prints the peer as `host<port>`: a line cut before it names none.
    text = "socketProgress: Connection closed by remote peer\nSIGABRT on rank 0\n"
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed" and not rc.culprit.hosts


# -- a traceback's end, a checkpoint's place, a rank with nothing in flight ---------------------------------------

_SPAWN = (
    "torch.multiprocessing.spawn.ProcessRaisedException:\n\n"
    "-- Process 2 terminated with the following error:\n"
    "Traceback (most recent call last):\n"
    '  File "/opt/conda/lib/python3.10/site-packages/torch/multiprocessing/spawn.py", line 69, in _wrap\n'
    "    fn(i, *args)\n"
    '  File "/work/train.py", line 31, in worker\n'
)


def test_a_spawned_process_whose_cut_traceback_ends_in_the_dataloader_failed_in_its_input_pipeline(tmp_path):
    text = _SPAWN + (
        "    batch = next(iter(loader))\n"
        '  File "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py", line 435, in __iter__\n'
        "    return self._get_iterator()\n"
        '  File "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py", line 381, in _get_iterator\n'
        "    return _MultiProcessingDataLoaderIter(self)\n"
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "dataloader_stall" and rc.culprit.ranks == [2]
    assert "dataloader.py" in rc.summary


def test_a_spawned_process_whose_cut_traceback_ends_in_its_own_code_stays_a_crash(tmp_path):
    text = _SPAWN + (
        '    loss = model(batch)\n  File "/work/model.py", line 88, in forward\n    h = self.block(x)\n'
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "rank_crashed"


def test_pytests_e_prefix_is_taken_off_a_pasted_traceback(tmp_path):
    text = "".join(f"E       {line}\n" if line else "E\n" for line in _SPAWN.splitlines()) + (
        'E         File "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py", line 435, in '
        "__iter__\n"
    )
    assert _verdict(tmp_path, text).root_cause.category == "dataloader_stall"


def _timeout_at(end: str, seq: int = 88) -> str:
    return (
        f"[rank1]:[E501 {end}.012345678 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation "
        f"timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
        "600012 milliseconds before timing out.\n"
    )


def test_a_frameworks_checkpoint_line_is_a_save_the_timed_out_collective_started_at(tmp_path):
    save = (
        "[2024-05-01 11:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] [Torch] Checkpoint global_step1200 is "
        "about to be saved!\n"
    )
    rc = _verdict(tmp_path, save + _timeout_at("11:10:00")).root_cause
    assert rc.category == "io_stall"
    done = (
        "  [2024-05-01 11:00:00.000001] successfully saved checkpoint from iteration    1200 to /ckpt/run1 "
        "[ t 1/8, gtp_remat 1/1, p 1/4 ]\n"
    )
    rc = _verdict(tmp_path, done + _timeout_at("11:10:00"), "done.txt").root_cause
    assert rc.category != "io_stall"  # the save had finished: the job went on past it


def _dump(rank: int, enqueued: int, completed: int, frm: str = " rank 0") -> str:
    return (
        f"[rank{rank}]:[E501 10:30:06.884528282 ProcessGroupNCCL.cpp:1987] [PG ID 0 PG GUID 0(default_pg) Rank "
        f"{rank}] Received a dump signal due to a collective timeout from {frm} and we will try our best to dump "
        f"the debug info. Last enqueued NCCL work: {enqueued}, last completed NCCL work: {completed}.This is most "
        "likely caused by incorrect usages of collectives.\n"
    )


def test_a_rank_whose_own_counters_show_nothing_in_flight_never_issued_the_collective(tmp_path):
    text = (
        _timeout_at("10:30:05").replace("rank1", "rank0").replace("Rank 1", "Rank 0")
        + _dump(0, 88, 87, "this local rank").replace(" from  this", " from this")
        + _dump(3, 87, 87)
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "conditional_collective" and rc.culprit.ranks == [3]
    near = text.replace("Last enqueued NCCL work: 87, last completed NCCL work: 87", "Last enqueued NCCL work: 88, "
                        "last completed NCCL work: 87")  # fmt: skip
    rc = _verdict(tmp_path, near, "near.txt").root_cause
    assert rc.category == "unknown" and not rc.culprit.ranks  # it waits like the rest


# -- which row speaks for a line a parser read ------------------------------------------------------------------


def _event(kind: str, **marks) -> LogEvent:
    return LogEvent(kind, Quote("dmesg", 1, "line"), fields=dict(marks))


def test_a_generic_context_row_does_not_veto_the_message_a_parser_recognised():
    # Any NCCL WARN line is a context row (kind nccl_warn); the parser read this one as an IB port error.
    e = _event("nccl_port_error", signal_row="x", signal_category=None, signal_strength="context",
               signal_event="nccl_warn")  # fmt: skip
    assert row_vote(e, "network_fault") == "parser"
    assert votes([e], "network_fault") == [e]


def test_the_specific_context_row_of_the_parsers_own_kind_does_not_vote():
    # Xid 45's own row (kind xid): the driver's cleanup after an earlier error, a consequence.
    e = _event(
        "xid", signal_row="nvidia.xid.45", signal_category=None, signal_strength="context", signal_event="xid"
    )
    assert row_vote(e, "gpu_fault") is None and votes([e], "gpu_fault") == []


def test_a_row_that_commits_to_another_category_speaks_whatever_its_kind():
    e = _event("nccl_port_error", signal_row="y", signal_category="rank_crashed", signal_strength="suggestive",
               signal_event="peer_closed")  # fmt: skip
    assert row_vote(e, "network_fault") is None and row_vote(e, None) == "suggestive"
