"""Shapes people paste with no rank in them: an uncaught exception's traceback, a job whose every process stopped at
the same start-up line, kernel and Slurm lines that the reader's clean-up must not spoil."""

from __future__ import annotations

import io

from hangdx.playbooks import engine
from hangdx.probes.model import Evidence, Source
from hangdx.probes.reader import clean, read_any


def verdict(text: str):
    ev = Evidence()
    read_any(io.BytesIO(text.encode()), Source("paste.log"), ev)
    return engine.run(ev)


TRACEBACK = """Traceback (most recent call last):
  File "/workspace/train.py", line 212, in <module>
    main()
  File "/workspace/train.py", line 180, in main
    loss = model(batch)
  File "/workspace/model.py", line 88, in forward
    x = self.embed(input_ids)
{last}
"""


def test_an_uncaught_exception_with_no_rank_is_a_process_that_died():
    v = verdict(TRACEBACK.format(last="IndexError: index out of range in self"))
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == []  # which rank, the text does not say
    assert "IndexError" in v.root_cause.summary


def test_ctrl_c_and_the_waiting_sides_errors_are_not_a_death():
    assert verdict(TRACEBACK.format(last="KeyboardInterrupt")).root_cause.category != "rank_crashed"
    timeout = "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 7/8 clients joined."
    assert verdict(TRACEBACK.format(last=timeout)).root_cause.category != "rank_crashed"


def test_every_process_stopped_at_the_jit_extension_build():
    line = "Using /root/.cache/torch_extensions/py310_cu118 as PyTorch extensions root...\n"
    v = verdict(line * 4)
    assert v.root_cause.category == "user_deadlock"
    assert "lock" in v.root_cause.fix


def test_a_build_that_went_on_is_not_where_the_job_stopped():
    text = (
        "Using /root/.cache/torch_extensions/py310_cu118 as PyTorch extensions root...\n"
        "[rank0]:[E1205 04:35:53.584483882 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=3348, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for "
        "1800098 milliseconds before timing out.\n"
    )
    assert verdict(text).root_cause.category != "user_deadlock"


def test_star_runs_that_the_message_prints_are_not_markdown_bold():
    for line in (
        "slurmstepd: error: *** JOB 4412345 ON gpu-node-03 CANCELLED AT 2024-05-01T12:00:04 DUE TO TIME LIMIT ***",
        "[gpu-node-03:03599] *** Process received signal ***",
    ):
        assert clean([(1, line.encode())])[0].text == line
    assert clean([(1, b"**RuntimeError: boom**")])[0].text == "RuntimeError: boom"


def test_device_names_before_a_kernel_message_are_not_hosts():
    for line in (
        "bond0: (slave ens1f0): link status definitely down, disabling slave",
        "nvme0n1: Read(0x2) @ LBA 1234567, 8 blocks, Unrecovered Read Error (sct 0x2 / sc 0x81) DNR",
        "ib0: multicast join failed for ff12:401b:ffff:0000:0000:0000:ffff:ffff, status -22",
    ):
        ln = clean([(1, line.encode())])[0]
        assert ln.host is None and ln.text == line
    assert clean([(1, b"gpu-node-07: NCCL WARN x")])[0].host == "gpu-node-07"


def test_a_ghes_record_is_a_log_line_not_json():
    v = verdict("{1}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0\n")
    assert v.root_cause is not None


def test_an_exception_raised_in_process_group_set_up_is_a_set_up_failure():
    text = """Traceback (most recent call last):
  File "train.py", line 413, in init_distribution
    torch.distributed.init_process_group(backend=backend)
  File "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", line 354, in init_process_group
    store, rank, world_size = next(rendezvous(url))
  File "/usr/lib/python3/site-packages/torch/distributed/rendezvous.py", line 143, in _env_rendezvous_handler
    store = TCPStore(master_addr, master_port, start_daemon)
ValueError: host not found: Name or service not known
"""
    v = verdict(text)
    assert v.root_cause.category == "comm_init_failure"
    assert "_env_rendezvous_handler" in v.root_cause.summary


def test_every_process_stopped_at_the_data_loaders_start():
    line = "2024-08-20 15:00:38,102: rank{r}[11386{r}][MainThread]: DEBUG: composer.trainer.trainer: Spinning the dataloaders\n"
    v = verdict("".join(line.format(r=r) for r in range(4)))
    assert v.root_cause.category == "dataloader_stall"


def test_ps_aux_rows_under_a_grep_are_read_by_the_command_above_them():
    text = """root@node-7:~# ps aux | grep train
root      123312  0.1  0.0   4508  1536 pts/0    Ss+  Sep24   1:00 python train.py --rank 0
root      123315  0.0  0.0   4508  1536 pts/0    Ds+  Sep24   0:12 python train.py --rank 1
"""
    v = verdict(text)
    assert v.root_cause.category == "io_stall"
    assert "123315" in v.root_cause.summary and "D state" in v.root_cause.summary


def test_faulthandler_frames_without_their_thread_line_are_a_stack():
    text = """  File "/usr/lib/python3.7/multiprocessing/util.py", line 400 in _flush_std_streams
  File "/usr/lib/python3.7/multiprocessing/process.py", line 317 in _bootstrap
  File "/usr/lib/python3.7/multiprocessing/popen_fork.py", line 74 in _launch
"""
    v = verdict(text)
    assert v.root_cause.category == "user_deadlock"
    assert "_flush_std_streams" in v.root_cause.summary


def test_horovods_mismatched_request_is_a_mismatch_not_a_crash():
    text = (
        "[1,0]<stderr>:tensorflow.python.framework.errors_impl.FailedPreconditionError: Mismatched ALLREDUCE "
        "CPU/GPU device selection: One rank specified device CPU, but another rank specified device GPU.\n"
    )
    assert verdict(text).root_cause.category == "collective_mismatch"


def test_a_gpu_hang_before_the_timeouts_is_the_cause_not_their_sequence():
    hang = "HW Exception by GPU node-9 (Agent handle: 0x631351bb5a20) reason :GPU Hang\n"
    timeout = (
        "[rank{r}]:[E1109 16:13:20.222288244 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum={s}, OpType=_REDUCE_SCATTER_BASE, NumelIn=67108864, NumelOut=8388608, "
        "Timeout(ms)=600000) ran for 600038 milliseconds before timing out.\n"
    )
    text = hang * 3 + "".join(timeout.format(r=r, s=500045 if r in (3, 4) else 500047) for r in range(1, 8))
    assert verdict(text).root_cause.category == "gpu_fault"


def test_an_rdma_port_that_is_not_active_is_a_network_fault():
    text = "link mlx5_7/1 subnet_prefix fe80:0000:0000:0000 lid 3403 sm_lid 1 lmc 0 state DOWN physical_state POLLING\n"
    assert verdict(text).root_cause.category == "network_fault"
    off = "link mlx5_2/1 state DOWN physical_state DISABLED\n"
    assert verdict(off).root_cause.category != "network_fault"  # administratively off: an unused port


# py-filelock's DEBUG lines (tox-dev/filelock src/filelock/_api.py), as logging's default format prints them.
LOCK_TRY = "DEBUG:filelock:Attempting to acquire lock {id} on /home/u/.triton/autotune/kernel.pickle.lock\n"


def test_every_process_stopped_waiting_for_a_lock_file():
    v = verdict("".join(LOCK_TRY.format(id=i) for i in (140192009925296, 140233385915056, 140592852660912)))
    rc = v.root_cause
    assert rc.category == "io_stall"
    assert (
        rc.confidence < 0.6
    )  # the lock is where they wait; why its holder does not let go, the text cannot say
    assert "/home/u/.triton/autotune/kernel.pickle.lock" in rc.fix


def test_a_lock_that_was_acquired_is_not_where_the_job_stopped():
    text = (
        LOCK_TRY.format(id=1)
        + "DEBUG:filelock:Lock 1 acquired on /home/u/.triton/autotune/kernel.pickle.lock\n"
    )
    assert verdict(text).root_cause.category != "io_stall"


# torchvision's MetricLogger line (references/classification/utils.py): `time:` a step, `data:` its wait for a batch.
METRIC = "Epoch: [0]  [ {i}/10175]  eta: 2 days, 11:04:48  lr: 0.000002  loss: 6.2285  time: {t}  data: {d}  max mem: 10768\n"


def test_steps_that_wait_most_of_their_time_for_data_are_the_input_pipeline():
    v = verdict(
        METRIC.format(i=100, t="39.8011", d="37.9013") + METRIC.format(i=200, t="40.1906", d="38.0570")
    )
    rc = v.root_cause
    assert rc.category == "dataloader_stall"
    assert "38.057 s" in rc.summary and "95%" in rc.summary


def test_steps_that_compute_are_not_blamed_on_data():
    v = verdict(METRIC.format(i=200, t="40.1906", d="0.0570"))
    assert "data_bound_steps" not in {f.playbook for f in v.findings}
    quick = verdict(METRIC.format(i=200, t="0.3870", d="0.3021"))  # a fast step: no stall to speak of
    assert "data_bound_steps" not in {f.playbook for f in quick.findings}


def test_a_garbled_rng_state_from_a_broadcast_is_a_divergence_of_no_named_rank():
    v = verdict("[rank1]: generator.set_state(rng_state)\n[rank1]: RuntimeError: Invalid mt19937 state\n")
    rc = v.root_cause
    assert rc.category == "conditional_collective"
    assert (
        rc.culprit.ranks == []
    )  # rank 1 received rank 0's broadcast wrong: which rank diverged, it cannot say
    assert rc.confidence < 0.7


# NCCL's line when a process takes its communicator down (init.cc), as EleutherAI/sparsify #68 shows it.
ENDED = "node:35{r}:39{r} [{r}] NCCL INFO comm 0xcf4437{r} rank {r} nranks 4 cudaDev {r} busId {r}00000 - Abort COMPLETE\n"
BAR = "Training: 100%|█████████▉| 13907/13908 [1:58:03<00:00,  1.96it/s]\n"


def test_ranks_that_took_their_communicator_down_with_no_error_left_the_others_waiting():
    v = verdict(BAR + "".join(ENDED.format(r=r) for r in (3, 2, 1)))
    rc = v.root_cause
    assert rc.category == "conditional_collective"
    assert rc.culprit.ranks == [0]  # the one rank that never finished
    assert "13907/13908" in rc.summary


def test_aborts_after_a_timeout_are_the_teardown_not_ranks_that_finished():
    timeout = (
        "[rank0]:[E ProcessGroupNCCL.cpp:828] [Rank 0] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800002 milliseconds before timing out.\n"
    )
    v = verdict(timeout + "".join(ENDED.format(r=r) for r in (3, 2, 1)))
    assert "ranks_left_early" not in {f.playbook for f in v.findings}


def test_a_segfault_before_a_desync_report_is_the_named_rank_dying():
    # NVIDIA/nccl #2213: Abseil's signal report, then rank 0's watchdog and its desync report about rank 1.
    text = (
        "*** SIGSEGV received at time=1775734074 on cpu 19 ***\n"
        "PC: @     0xe1e2567f5014  (unknown)  ncclLocalOpAppend()\n"
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1155874, OpType=ALLREDUCE, "
        "NumelIn=9445376, NumelOut=9445376, Timeout(ms)=1800000) ran for 1800002 milliseconds before timing out.\n"
        "[1] finished collective #1155873, but didn't join collective #1155874\n"
    )
    rc = verdict(text).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [1]


NCCL_SETUP = """\
node1:2301:2301 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.11<0>
node1:2301:2301 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation
node2:4410:4410 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.12<0>
node1:2301:2390 [0] NCCL INFO NET/IB : No device found.
node1:2301:2390 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.11<0>
node1:2301:2390 [0] NCCL INFO Using network Socket
node2:4410:4470 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.12<0>
node2:4410:4470 [0] NCCL INFO Using network Socket
node1:2301:2390 [0] NCCL INFO Channel 00/02 :    0   1
"""


def test_every_process_stopped_inside_nccl_set_up_is_a_set_up_that_never_finished():
    v = verdict(NCCL_SETUP)
    assert v.root_cause.category == "comm_init_failure", v.root_cause
    assert v.root_cause.confidence < 0.5  # the text may simply end there
    assert "Init COMPLETE" in v.root_cause.summary


def test_nccl_set_up_stopped_on_one_host_is_the_gpus_peer_to_peer_path_suspected():
    # The same stop with every process on one host: the ranks reach each other without a network, and what NCCL's
    # troubleshooting guide names first there is the GPUs' peer-to-peer path (ACS, the IOMMU).
    one = "".join(ln for ln in NCCL_SETUP.splitlines(keepends=True) if ln.startswith("node1:"))
    one += "node1:2302:2391 [1] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.11<0>\n"
    rc = verdict(one).root_cause
    assert rc.category == "gpu_fault" and rc.culprit.hosts == ["node1"], rc
    assert rc.confidence < 0.5 and "suspected" in rc.summary
    assert "NCCL_P2P_DISABLE=1" in rc.fix
    assert any("p2pBandwidthLatencyTest" in s for s in rc.next_steps)
    # One process's lines, or a communicator bigger than what is on that host: one node's paste of a bigger job,
    # whose peers may be anywhere. A set-up that never finished, as before.
    single = "".join(ln for ln in one.splitlines(keepends=True) if ":2301:" in ln)
    assert verdict(single).root_cause.category == "comm_init_failure"
    bigger = (
        one
        + "node1:2301:2390 [0] NCCL INFO ncclCommInitRank comm 0x55d0 rank 0 nranks 16 cudaDev 0 busId 1000 - Init START\n"
    )
    assert verdict(bigger).root_cause.category == "comm_init_failure"


def test_nccl_set_up_that_completed_or_went_on_is_not_where_the_job_stopped():
    done = "node1:2301:2390 [0] NCCL INFO comm 0x55d0 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE\n"
    went_on = (
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad shape\n'
    )
    banner = "node1:2301:2301 [0] NCCL INFO NCCL version 2.18.1+cuda12.1\n"
    for text in (NCCL_SETUP + done, NCCL_SETUP + went_on, banner * 2):
        assert not any(f.playbook == "stopped_at_stage" for f in verdict(text).findings), text


def test_a_file_lock_the_file_system_cannot_grant_is_an_io_stall():
    loop = (
        'open("test.lock", O_RDWR|O_CREAT|O_TRUNC|O_CLOEXEC, 0777) = 3\n'
        "flock(3, LOCK_EX|LOCK_NB)               = -1 ENOSYS (Function not implemented)\n"
        "close(3)                                = 0\n"
        "select(0, NULL, NULL, NULL, {0, 50000}) = 0 (Timeout)\n"
    )
    assert verdict(loop * 3).root_cause.category == "io_stall"


STORE_CONNECT = """\
[I socket.cpp:580] [c10d - debug] The client socket will attempt to connect to an IPv6 address of (master-0, 23456).
[I socket.cpp:648] [c10d - trace] The client socket is attempting to connect to [10.1.0.200]:23456.
[I socket.cpp:725] [c10d] The client socket has connected to [10.1.0.200]:23456 on [worker-0]:38244.
"""


def test_every_process_stopped_after_connecting_to_the_store_is_stuck_in_rendezvous():
    v = verdict(STORE_CONNECT)
    assert v.root_cause.category == "comm_init_failure", v.root_cause
    assert "init_process_group" in v.root_cause.summary


def test_a_process_group_that_went_on_past_the_store_is_not_stopped_there():
    nccl = "node1:2301:2390 [0] NCCL INFO comm 0x55d0 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE\n"
    step = "step 10 loss 2.31\n" * 3
    for text in (STORE_CONNECT + nccl, STORE_CONNECT + step):
        assert not any(f.playbook == "stopped_at_stage" for f in verdict(text).findings), text


def test_a_store_wait_that_timed_out_while_data_preparation_went_on_is_a_straggler():
    bar = "Tokenizing Prompts (num_proc=64):  92%|█████████▏| 328986/359152 [29:58<12:05, 41.59 examples/s]"
    text = (
        bar + "[rank1]:[W516 14:34:56.853490829 socket.cpp:464] [c10d] waitForInput: poll for socket "
        "SocketImpl(fd=79, addr=[localhost]:41170, remote=[localhost]:29500) returned 0, likely a timeout\n"
        "[rank1]:[W516 14:34:56.854597329 socket.cpp:489] [c10d] waitForInput: socket SocketImpl(fd=79, "
        "addr=[localhost]:41170, remote=[localhost]:29500) timed out after 1800000ms\n"
    )
    v = verdict(text)
    assert v.root_cause.category == "straggler", v.root_cause
    assert v.root_cause.culprit.ranks == [0]  # the one rank not waiting: ranks count from 0


def test_every_process_stopped_preparing_its_dataset_is_the_data():
    text = (
        "INFO:megatron.bridge.data.packing.offline:Preparing packed sequence from /data/train.jsonl\n"
        "INFO:megatron.bridge.data.datasets.utils:Building data files\n"
        "INFO:megatron.bridge.data.datasets.utils:Processing 1 data files using 2 workers\n"
        "INFO:megatron.bridge.data.datasets.utils:Loading data files\n"
    )
    v = verdict(text)
    assert v.root_cause.category == "dataloader_stall", v.root_cause
    assert "dataset" in v.root_cause.summary
    assert verdict(text + "iteration 1/1000 | loss 2.31\n" * 3).root_cause.category != "dataloader_stall"


def test_py_spy_frames_pasted_without_their_process_and_thread_lines_are_a_stack():
    frames = (
        "    all_reduce (torch/distributed/distributed_c10d.py:3075)\n"
        "    train_step (train.py:41)\n"
        "    main (train.py:90)\n"
    )
    ev = Evidence()
    read_any(io.BytesIO(frames.encode()), Source("paste.log"), ev)
    assert len(ev.stacks) == 1 and [f.function for f in ev.stacks[0].threads[0].frames][:2] == [
        "all_reduce",
        "train_step",
    ]
    assert "allreduce" in verdict(frames).root_cause.summary


def test_one_frame_like_line_in_a_log_is_no_stack():
    text = "step 10 loss 2.31\n    helper (util.py:12)\nstep 11 loss 2.30\n"
    ev = Evidence()
    read_any(io.BytesIO(text.encode()), Source("paste.log"), ev)
    assert not ev.stacks


SELF_DUMP = """\
{head}
{indent}File{colon} "/usr/lib/python3.10/threading.py", line 973, in _bootstrap
{indent}File{colon} "train.py", line 88, in main
    loss.backward()
{indent}File{colon} "/usr/lib/python3.10/site-packages/torch/_tensor.py", line 522, in backward
    torch.autograd.backward(
{indent}File{colon} "/usr/lib/python3.10/site-packages/torch/autograd/__init__.py", line 266, in backward
    Variable._execution_engine.run_backward(
"""


def test_a_stack_a_program_printed_of_itself_is_read_innermost_first():
    """The signal-handler recipe over sys._current_frames() (`# Thread: NAME(ID)`, `File: "x", line N, in f`) and
    traceback.format_stack's frames with no Traceback line: a thread's stack, outermost call first."""
    for head, indent, colon in (
        ("# Thread: MainThread(140234)", "", ":"),
        ("######### ProcessID=82627, ThreadID=4617211392 #########", "", ":"),
        ("", "  ", ""),
    ):
        ev = Evidence()
        read_any(
            io.BytesIO(SELF_DUMP.format(head=head, indent=indent, colon=colon).encode()), Source("d.txt"), ev
        )
        assert len(ev.stacks) == 1, head
        frames = ev.stacks[0].threads[0].frames
        assert frames[0].function == "backward" and frames[-1].function == "_bootstrap", head
        if "ProcessID" in head:
            assert ev.stacks[0].pid == 82627


def test_an_exception_traceback_is_still_a_traceback_not_a_stack():
    v = verdict(TRACEBACK.format(last="IndexError: index out of range in self"))
    assert v.root_cause.category == "rank_crashed"
