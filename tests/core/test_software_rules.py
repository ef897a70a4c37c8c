"""Rules an engineer reads from the emitters' own messages (issue 24, software side).

Every input here is written by hand in the emitter's format (the format each rule's catalogue row or docstring
cites), never copied from a case: the real cases these rules were written for are in tests/fixtures/real/ and
run in tests/core/test_real_corpus.py. Each test also checks the reading does not fire on the neighbouring case.
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source


def verdict(text: str, name: str = "paste.log"):
    ev = Evidence()
    reader.read_text([text.encode()], Source(name), ev)
    return engine.run(ev).root_cause


FP = "CollectiveFingerPrint(SequenceNumber={seq}, OpType={op}, TensorShape=[{shape}], TensorDtypes=Float)"


def _mismatch(seq_a: int, op_a: str, seq_b: int, op_b: str) -> str:
    a = FP.format(seq=seq_a, op=op_a, shape=8)
    b = FP.format(seq=seq_b, op=op_b, shape=8)
    return (
        f"RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: {a}, "
        f"but Rank 0 is running collective: {b}.\n"
    )


def test_a_mismatch_across_sequence_numbers_is_ranks_in_different_calls():
    rc = verdict(_mismatch(120, "BROADCAST", 7, "ALLREDUCE"))
    assert rc.category == "conditional_collective", rc.summary
    assert "sequence numbers 7 vs 120" in rc.summary and rc.culprit.ranks == []


def test_a_mismatch_at_one_sequence_number_stays_a_mismatch():
    rc = verdict(_mismatch(12, "BROADCAST", 12, "ALLREDUCE"))
    assert rc.category == "collective_mismatch", rc.summary


def test_an_inconsistent_collective_inside_ddps_own_broadcast_is_a_divergence():
    line = (
        "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running inconsistent collective: "
        "CollectiveFingerPrint(OpType=BROADCAST, TensorShape=[4], TensorDtypes=Float)\n"
    )
    rc = verdict("      dist._broadcast_coalesced(\n" + line)
    assert rc.category == "conditional_collective", rc.summary
    # The same report from the user's own broadcast says nothing about which differs: a mismatch.
    rc = verdict("      dist.broadcast(t, src=0)\n" + line)
    assert rc.category == "collective_mismatch", rc.summary


def _running(rank: int, seq: int, shape: str) -> str:
    return (
        f"[rank{rank}]:[I1017 19:34:58.923985894 ProcessGroupWrapper.cpp:587] [Rank {rank}] Running collective: "
        f"CollectiveFingerPrint(SequenceNumber={seq}, OpType=ALLREDUCE, TensorShape=[{shape}], TensorDtypes=Float, "
        "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cuda))\n"
    )


def test_detail_fingerprints_at_one_number_name_the_odd_rank_out():
    text = (
        _running(0, 5, "64, 1") + _running(1, 5, "64, 1") + _running(2, 5, "50, 1") + _running(3, 5, "64, 1")
    )
    rc = verdict(text)
    assert rc.category == "collective_mismatch", rc.summary
    assert rc.culprit.ranks == [2]
    assert "[50, 1]" in rc.summary


def test_detail_fingerprints_that_agree_accuse_nobody():
    text = "".join(_running(r, 5, "64, 1") for r in range(4))
    rc = verdict(text)
    assert rc.category != "collective_mismatch", rc.summary


def _nccl(dev: int, pid: int, count: int, dtype: int) -> str:
    return (
        f"node7:{pid}:{pid} [{dev}] NCCL INFO AllReduce: opCount 3 sendbuff 0x7f0000000000 recvbuff 0x7f0000000000 "
        f"count {count} datatype {dtype} op 0 root 0 comm 0x7f00000{dev}a260 [nranks=4] stream 0x55f20d2f5db0\n"
    )


def test_nccl_info_lines_at_one_op_count_name_the_process_that_differs():
    text = _nccl(0, 100, 1024, 7) + _nccl(1, 101, 1024, 7) + _nccl(2, 102, 1000, 7) + _nccl(3, 103, 1024, 7)
    rc = verdict(text)
    assert rc.category == "collective_mismatch", rc.summary
    assert rc.culprit.ranks == [2] and rc.culprit.gpus == ["node7:2"]


def test_mpich_self_send_deadlock_names_the_one_process_that_aborted():
    text = (
        "Fatal error in MPI_Send: Other MPI error, error stack:\n"
        "MPI_Send(173): MPI_Send(buf=0x1234, count=1, MPI_INT, dest=3, tag=1, MPI_COMM_WORLD) failed\n"
        "MPID_Send(53): DEADLOCK: attempting to send a message to the local process without a prior matching receive\n"
        "job aborted:\n"
        "rank: node: exit code[: error message]\n"
        "3: node12: 1: Fatal error in MPI_Send: Other MPI error, error stack:\n"
    )
    rc = verdict(text)
    assert rc.category == "p2p_deadlock", rc.summary
    assert rc.culprit.ranks == [3]
    two = text + "5: node13: 1: Fatal error in MPI_Send: Other MPI error, error stack:\n"
    assert verdict(two).culprit.ranks == []  # two processes aborted: no telling whose stack it was


def test_mxnet_worker_timeout_is_a_data_loader_stall():
    text = (
        "Worker timed out after 60 seconds. This might be caused by \n\n"
        "            - Slow transform. Please increase timeout to allow slower data loading in each worker.\n"
    )
    assert verdict(text).category == "dataloader_stall"


def test_threads_pasted_by_name_are_read_as_a_py_spy_dump():
    text = (
        "Thread MainThread (idle):\n"
        "    _wait_for_tstate_lock (threading.py:1169)\n"
        "    join (threading.py:1149)\n"
        "    stop (mylib/worker.py:47)\n"
        "Thread-2 (idle):\n"
        "    acquire (mylib/locks.py:17)\n"
        "    run (mylib/worker.py:69)\n"
    )
    rc = verdict(text)
    assert rc.category == "user_deadlock", rc.summary


def test_a_ray_worker_waits_where_its_training_thread_waits():
    text = (
        "Process 4242: ray::RayTrainWorker\n"
        "Python v3.11.9 (/usr/bin/python3.11)\n\n"
        'Thread 4242 (idle): "MainThread"\n'
        "    main_loop (ray/_private/worker.py:946)\n"
        "    <module> (ray/_private/workers/default_worker.py:330)\n"
        'Thread 4300 (idle): "TrainingThread(train_fn_per_worker)"\n'
        "    get (multiprocessing/queues.py:113)\n"
        "    _try_get_data (torch/utils/data/dataloader.py:1133)\n"
        "    _get_data (torch/utils/data/dataloader.py:1278)\n"
        "    _next_data (torch/utils/data/dataloader.py:1329)\n"
        "    __next__ (torch/utils/data/dataloader.py:631)\n"
        "    train_loop (train.py:55)\n"
    )
    assert verdict(text).category == "dataloader_stall"


def test_average_meter_lines_name_the_rank_that_waits_for_data():
    lines = [
        "[GPU rank {r}] Epoch: [1][100/500]    Time 0.700 (2.500)      Data 0.010 ({d})      Loss 1.0 (1.2)"
    ]
    text = "".join(
        lines[0].format(r=r, d=d) + "\n" for r, d in ((0, "0.020"), (1, "1.500"), (2, "0.015"), (3, "0.030"))
    )
    rc = verdict(text)
    assert rc.category == "straggler", rc.summary
    assert rc.culprit.ranks == [1]


def test_a_rank_still_preparing_data_while_the_others_time_out_holds_them_up():
    timeout = (
        "[default{r}]:[E ProcessGroupNCCL.cpp:475] [Rank {r}] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600888 "
        "milliseconds before timing out.\n"
    )
    bar = "[default0]:Running tokenizer on dataset:  12%|█▏        | 1200/10000 [01:00<07:20, 20.00 examples/s]\n"
    rc = verdict(bar + timeout.format(r=1) + timeout.format(r=2) + timeout.format(r=3))
    assert rc.category == "straggler", rc.summary
    assert rc.culprit.ranks == [0]


def test_a_pipeline_stage_losing_its_peer_in_a_p2p_wait_with_no_failure_of_its_own():
    tb = (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/opt/train.py", line 70, in run\n'
        "[rank1]:     schedule.step(x)\n"
        '[rank1]:   File "/usr/lib/python3.11/site-packages/torch/distributed/pipelining/schedules.py", line 708, '
        "in _step_microbatches\n"
        "[rank1]:     work.wait()\n"
        "[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:525] Read error [10.0.0.2]:42417: "
        "Connection reset by peer\n"
    )
    rc = verdict(tb)
    assert rc.category == "p2p_deadlock", rc.summary
    oom = "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert verdict(tb + oom).category != "p2p_deadlock"  # a rank that failed on its own explains the reset


def test_detail_fingerprints_show_the_rank_that_stopped_issuing_collectives():
    text = "".join(_running(r, 40, "8") for r in range(4)) + "".join(_running(r, 41, "8") for r in (0, 1, 3))
    rc = verdict(text)
    assert rc.category == "conditional_collective", rc.summary
    assert rc.culprit.ranks == [2] and "#41" in rc.summary


def test_a_ctrl_c_echo_before_the_traceback_still_shows_where_the_process_waited():
    text = (
        "^CTraceback (most recent call last):\n"
        '  File "train.py", line 120, in <module>\n'
        "    for i, batch in enumerate(loader):\n"
        '  File "/usr/lib/python3.10/site-packages/torch/utils/data/dataloader.py", line 633, in __next__\n'
        "    data = self._next_data()\n"
        '  File "/usr/lib/python3.10/site-packages/torch/utils/data/dataloader.py", line 1132, in _try_get_data\n'
        "    data = self._data_queue.get(timeout=timeout)\n"
        '  File "/usr/lib/python3.10/multiprocessing/queues.py", line 113, in get\n'
        "    if not self._poll(timeout):\n"
        "KeyboardInterrupt\n"
    )
    assert verdict(text).category == "dataloader_stall"


def test_a_notebooks_interrupted_traceback_shows_where_the_process_waited():
    text = (
        "---------------------------------------------------------------------------\n"
        "KeyboardInterrupt                         Traceback (most recent call last)\n"
        "<ipython-input-7-2f1d3c> in <module>\n"
        "      1 for epoch in range(10):\n"
        "----> 2     for x, y in train_loader:\n\n"
        "/usr/local/lib/python3.8/dist-packages/torch/utils/data/dataloader.py in __next__(self)\n"
        "    434             self._reset()\n"
        "--> 435         data = self._next_data()\n\n"
        "/usr/lib/python3.8/multiprocessing/queues.py in get(self, block, timeout)\n"
        "--> 107                 if not self._poll(timeout):\n\n"
        "KeyboardInterrupt: \n"
    )
    rc = verdict(text)
    assert rc.category == "dataloader_stall", rc.summary
    assert "ipython-input-7-2f1d3c>:2" in rc.summary


def _sized(op: str, ra: int, rb: int, na: int, nb: int, dtype: str = "BFloat16") -> str:
    fp = "CollectiveFingerPrint(SequenceNumber=35, OpType={op}, TensorShape=[{n}], TensorDtypes={dt}, "
    fp += "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cuda))"
    a, b = fp.format(op=op, n=na, dt=dtype), fp.format(op=op, n=nb, dt=dtype)
    return (
        f"RuntimeError: Detected mismatch between collectives on ranks. Rank {ra} is running collective: {a}, "
        f"but Rank {rb} is running collective: {b}.Collectives differ in the following aspects: "
        f"  Tensor Tensor shapes: {na}vs {nb}\n"
    )


def test_a_sharded_all_gather_of_different_sizes_is_ranks_at_different_parameter_units():
    # FSDP / ZeRO-3 pad every rank's shard of one unit to one size: different sizes are different units
    for op, ra, rb in (("_ALLGATHER_BASE", 4, 7), ("_REDUCE_SCATTER_BASE", 0, 3), ("_ALLGATHER_BASE", 12, 1)):
        rc = verdict(_sized(op, ra, rb, 9634624, 2464056))
        assert rc.category == "conditional_collective", rc.summary
        assert "different parameter units" in rc.summary and rc.culprit.ranks == []


def test_a_plain_all_gather_or_all_reduce_of_different_sizes_stays_a_mismatch():
    for op in ("ALLGATHER", "ALLREDUCE", "BROADCAST"):
        assert verdict(_sized(op, 4, 7, 9634624, 2464056)).category == "collective_mismatch"
    # the same sharded op whose shapes agree: the difference lies elsewhere, inside one call
    rc = verdict(_sized("_ALLGATHER_BASE", 4, 7, 100, 100, "Float"))
    assert rc.category == "collective_mismatch", rc.summary
    # an all-gather of a tensor of several dimensions (an activation split unevenly) is a mismatch in one call
    text = (
        _sized("_ALLGATHER_BASE", 1, 2, 0, 0)
        .replace("[0]", "[359, 1, 1435, 16]", 1)
        .replace("[0]", "[359, 1, 1436, 16]", 1)
    )
    assert verdict(text).category == "collective_mismatch"
