"""Stacks and process reports beyond py-spy dumps: gdb `bt`/`py-bt`, `py-spy top`, faulthandler, Ctrl-C
tracebacks, `ps` tables and `/proc/PID/stack`, and what the stack classification makes of them.

Fixtures in fixtures/gdb, fixtures/faulthandler, fixtures/pyspy_top and fixtures/ps_table were recorded on this
machine (gdb 13 attached to CPython 3.11.7, py-spy 0.4 top --idle, ps from procps-ng; see each folder's README).
Short texts below are lines from the real corpus (tests/fixtures/real/, named at each test) or in those tools'
formats.
"""

from __future__ import annotations

from pathlib import Path

from hangdx.playbooks import engine
from hangdx.playbooks.facts import classify
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.model import Evidence

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def read(text: str) -> Evidence:
    return evidence_from_paths(["-"], stdin=text.encode())


def verdict(text: str):
    return engine.run(read(text)).root_cause


# -- gdb ---------------------------------------------------------------------------------------------------

# pytorch/pytorch#58239 (tests/fixtures/real/user_deadlock__pytorch-pytorch-58239.log)
MUTEX_BT = """\
#0  __lll_lock_wait (futex=futex@entry=0x7f76f1ed2598, private=0x0) at lowlevellock.c:52
#1  0x00007f799c183c42 in __GI___pthread_mutex_lock (mutex=0x7f76f1ed2598) at ../nptl/pthread_mutex_lock.c:80
#2  0x00007f790845de98 in std::mutex::lock (this=0x7f76f1ed2598) at bits/std_mutex.h:100
#3  0x00007f79088a4eac in std::unique_lock<std::mutex>::lock (this=0x7ffcac6e2d48) at bits/unique_lock.h:142
"""


def test_a_bare_gdb_bt_is_one_thread_of_native_frames():
    ev = read(MUTEX_BT)
    [dump] = ev.stacks
    [t] = dump.threads
    assert [f.function for f in t.frames] == [
        "__lll_lock_wait", "__GI___pthread_mutex_lock", "std::mutex::lock", "std::unique_lock<std::mutex>::lock",
    ]  # fmt: skip
    assert all(f.native for f in t.frames)
    assert t.frames[1].file == "../nptl/pthread_mutex_lock.c" and t.frames[1].line == 80


def test_a_thread_blocked_on_a_mutex_is_a_user_deadlock():
    rc = verdict(MUTEX_BT)
    assert rc.category == "user_deadlock"
    assert any("__lll_lock_wait" in q.text for q in rc.evidence)


def test_a_mutex_wait_inside_nccl_is_the_collective_not_a_deadlock():
    text = (
        MUTEX_BT
        + "#4  0x00007f4d8f657622 in c10d::ProcessGroupNCCL::WorkNCCL::wait() () from libtorch_cuda.so\n"
    )
    loc = classify(read(text).stacks[0], None)
    assert loc.kind == "collective"


def test_thread_apply_all_bt_recorded_names_thread_1_the_main_thread():
    ev = evidence_from_paths([str(FIX / "gdb" / "thread_apply_all_bt_lock.txt")])
    [dump] = ev.stacks
    assert [t.name for t in dump.threads] == ["python", "MainThread"]
    main = dump.main_thread()
    assert main.tid == 22987 and main.frames[0].function == "__futex_abstimed_wait_common64"
    # `#2  time_sleep (...)`: an inlined frame without an address is a frame too
    other = dump.threads[0]
    assert other.frames[2].function == "time_sleep"
    assert classify(dump, None).kind == "lock"  # main thread in PyThread_acquire_lock / sem_wait


# pytorch/pytorch#120683 (tests/fixtures/real/p2p_deadlock__pytorch-pytorch-120683.log)
COALESCED = """\
100.00% 100.00%   241.8s    241.8s   _coalescing_manager (torch/distributed/distributed_c10d.py:1978)

#0  0x00007f4daad159e5 in clock_nanosleep@GLIBC_2.2.5 () from /lib64/libc.so.6
#2  0x00007f4daad45799 in usleep () from /lib64/libc.so.6
#3  0x00007f4d91788155 in groupLaunch(ncclAsyncJob*) () from /opt/torch/lib/libtorch_cuda.so
#4  0x00007f4d917879e3 in ncclGroupEndInternal() () from /opt/torch/lib/libtorch_cuda.so
#7  0x00007f4d8f6572be in c10d::ProcessGroupNCCL::endCoalescing(c10d::OpType) ()
   from /opt/torch/lib/libtorch_cuda.so
"""


def test_a_wrapped_gdb_frame_keeps_its_library_and_its_cpp_signature():
    gdb = [d for d in read(COALESCED).stacks if d.threads[0].frames[0].native][0]
    f = gdb.threads[0].frames[-1]
    assert f.function == "c10d::ProcessGroupNCCL::endCoalescing(c10d::OpType)"
    assert f.file == "/opt/torch/lib/libtorch_cuda.so"


def test_a_rank_inside_a_batched_send_recv_waits_on_its_peer():
    rc = verdict(COALESCED)
    assert rc.category == "p2p_deadlock"


def test_py_bt_waiting_for_the_gil_is_a_lock_wait():
    ev = evidence_from_paths([str(FIX / "gdb" / "thread_apply_all_py_bt_gil.txt")])
    [dump] = ev.stacks
    main = dump.main_thread()
    assert main.tid == 23661 and main.frames[0].function == "Waiting for the GIL"
    assert main.frames[1].function == "wait" and main.frames[1].line == 327
    loc = classify(dump, None)
    assert (loc.kind, loc.op) == ("lock", "the GIL")
    assert engine.run(ev).root_cause.category == "user_deadlock"


def test_a_native_bt_in_take_gil_is_a_gil_wait():
    ev = evidence_from_paths([str(FIX / "gdb" / "bt_thread1_gil.txt")])
    [dump] = ev.stacks
    assert len(dump.threads) == 1 and dump.threads[0].name == "MainThread"  # `[Switching to thread 1 ...]`
    assert classify(dump, None).op == "the GIL"


# pytorch/pytorch#97833 (tests/fixtures/real/user_deadlock__pytorch-pytorch-97833.log): py-bt without its header
def test_py_bt_pasted_from_waiting_for_the_gil_on():
    text = """\
  Waiting for the GIL
  <built-in method _invoke_rpc_python_udf of PyCapsule object at remote 0x7f910957bea0>
  File "/opt/lib/python3.9/site-packages/torch/distributed/rpc/api.py", line 719, in _invoke_rpc
    fut = _invoke_rpc_python_udf(
"""
    assert verdict(text).category == "user_deadlock"


# -- py-spy top --------------------------------------------------------------------------------------------


def test_py_spy_top_rows_on_every_sample_make_the_stack():
    ev = evidence_from_paths([str(FIX / "pyspy_top" / "top_idle_two_threads.txt")])
    [dump] = ev.stacks
    funcs = [f.function for f in dump.threads[0].frames]
    assert set(funcs[:2]) == {"wait_for_lock", "worker"} and "_bootstrap" in funcs  # `Thread._bootstrap`
    assert not any(f.native for f in dump.threads[0].frames)


# -- faulthandler and Ctrl-C -------------------------------------------------------------------------------


def test_a_faulthandler_timeout_dump_is_a_stack_per_thread():
    ev = evidence_from_paths([str(FIX / "faulthandler" / "dump_traceback_later.txt")])
    [dump] = ev.stacks
    assert len(dump.threads) == 2
    main = dump.main_thread()
    assert main.frames[0].function == "wait_for_lock" and main.frames[-1].function == "<module>"
    assert not ev.events


def test_a_fatal_python_error_is_a_crash_report_not_a_stack():
    ev = evidence_from_paths([str(FIX / "faulthandler" / "segfault.txt")])
    assert not ev.stacks
    [e] = ev.events_of("segfault")
    assert e.fields["signal"] == "SIGSEGV" and e.fields["function"] == "string_at"
    assert engine.run(ev).root_cause.category == "rank_crashed"


# pytorch/pytorch#135486 (tests/fixtures/real/rank_crashed__pytorch-pytorch-135486.log), srun --label lines
def test_a_labelled_segfault_names_the_rank_and_the_host_its_nccl_lines_name():
    text = """\
0: g1002:2128869:2128880 [0] NCCL INFO Setting affinity for GPU 0 to ffff0000,00000000,ffff0000,00000000
0: Fatal Python error: Segmentation fault
0:
0: Thread 0x000014844b65d740 (most recent call first):
0:   File "/env/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3938 in barrier
0:   File "/test/1.basic.py", line 18 in <module>
"""
    rc = verdict(text)
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [0] and rc.culprit.hosts == ["g1002"]
    assert "barrier" in rc.summary


# wandb/wandb#3223 (tests/fixtures/real/user_deadlock__wandb-wandb-3223.log)
def test_a_traceback_ended_by_ctrl_c_shows_where_the_process_waited():
    text = """\
Traceback (most recent call last):
  File "/home/u/lib/python3.9/site-packages/wandb/sdk/internal/internal.py", line 153, in wandb_internal
    thread.join()
  File "/home/u/lib/python3.9/threading.py", line 1033, in join
    self._wait_for_tstate_lock()
  File "/home/u/lib/python3.9/threading.py", line 1049, in _wait_for_tstate_lock
    elif lock.acquire(block, timeout):
KeyboardInterrupt
"""
    ev = read(text)
    [dump] = ev.stacks
    assert [f.function for f in dump.threads[0].frames] == ["_wait_for_tstate_lock", "join", "wandb_internal"]
    assert verdict(text).category == "user_deadlock"


def test_another_exception_makes_no_stack():
    text = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n    f()\nValueError: x\n'
    assert not read(text).stacks


# -- ps tables and /proc/PID/stack -------------------------------------------------------------------------

# NVIDIA-NeMo/RL#3504 (tests/fixtures/real/io_stall__NVIDIA-NeMo-RL-3504.log), its row cut inside ELAPSED
PS_NFS = """\
 PID  STAT WCHAN                    ELAPSED      COMMAND
1533  DNl  nfs_start_io_read      1-22:05:5
"""


def test_a_ps_row_gives_state_and_wait_channel():
    [p] = read(PS_NFS).processes
    assert (p.pid, p.state, p.wchan) == (1533, "D", "nfs_start_io_read")


def test_a_process_in_d_state_on_nfs_is_an_io_stall():
    rc = verdict(PS_NFS)
    assert rc.category == "io_stall" and rc.culprit.processes == ["pid 1533"]
    assert rc.evidence[0].text.startswith("1533  DNl  nfs_start_io_read")


def test_a_process_asleep_on_a_futex_is_no_io_stall():
    ev = evidence_from_paths([str(FIX / "ps_table" / "ps_stat_wchan.txt")])
    [p] = ev.processes
    assert (p.pid, p.state, p.wchan) == (22987, "S", "futex_do_wait")
    assert engine.run(ev).root_cause.category != "io_stall"


def test_proc_pid_stack_in_nfs_is_an_io_stall():
    text = """\
$ sudo cat /proc/1533/stack
[<0>] rwsem_down_read_slowpath+0x2a8/0x4a0
[<0>] down_read+0x49/0x90
[<0>] nfs_start_io_read+0x1a/0x80 [nfs]
[<0>] nfs_file_read+0x52/0xa0 [nfs]
[<0>] vfs_read+0x1b4/0x340
"""
    ev = read(text)
    [p] = ev.processes
    assert (p.pid, p.wchan) == (1533, "nfs_start_io_read")
    assert engine.run(ev).root_cause.category == "io_stall"


def test_a_recorded_kernel_stack_on_a_futex_says_so():
    ev = evidence_from_paths([str(FIX / "ps_table" / "proc_pid_stack_futex.txt")])
    [p] = ev.processes
    assert p.wchan == "futex_do_wait"


# -- Python frames: storage I/O, output locks --------------------------------------------------------------

# ray-project/ray#26802 (tests/fixtures/real/io_stall__ray-project-ray-26802.log)
UPLOAD = """\
Thread 371 (idle): "MainThread"
    pthread_cond_wait@@GLIBC_2.3.2 (libpthread-2.27.so)
    std::condition_variable::wait (condition_variable.cc:55)
    arrow::fs::CopyFiles (pyarrow/libarrow.so.600)
    copy_files (pyarrow/fs.py:246)
    upload_to_uri (ray/air/_internal/remote_storage.py:173)
    save (ray/tune/trainable/trainable.py:490)
"""


def test_a_checkpoint_upload_through_pyarrow_fs_is_an_io_stall():
    ev = read(UPLOAD)
    main = ev.stacks[0].main_thread()
    assert main.frames[1].native  # a --native frame with a C++ source line is native code
    rc = engine.run(ev).root_cause
    assert rc.category == "io_stall" and "copy_files (pyarrow/fs.py:246)" in rc.summary


def test_an_s3_write_through_boto3_is_an_io_stall():
    text = """\
Thread 10 (idle): "MainThread"
    _send_request (botocore/endpoint.py:200)
    _make_api_call (botocore/client.py:1005)
    upload_fileobj (boto3/s3/inject.py:642)
    save_checkpoint (train.py:88)
"""
    assert classify(read(text).stacks[0], None).kind == "io"


# Textualize/rich#2046 (tests/fixtures/real/user_deadlock__Textualize-rich-2046.log)
FORKED_WORKER = """\
Thread 339 (idle): "MainThread"
    process_renderables (rich/live.py:246)
    print (rich/console.py:1600)
    write (rich/file_proxy.py:47)
    _showwarnmsg (warnings.py:112)
    __getitem__ (dataset.py:40)
    fetch (torch/utils/data/_utils/fetch.py:32)
    _worker_loop (torch/utils/data/_utils/worker.py:287)
    _launch (multiprocessing/popen_fork.py:75)
"""


def test_a_dataloader_worker_stuck_on_an_output_lock_is_a_user_deadlock():
    loc = classify(read(FORKED_WORKER).stacks[0], None)
    assert loc.kind == "lock" and "rich/live.py" in loc.detail
    assert verdict(FORKED_WORKER).category == "user_deadlock"


def test_a_logging_handler_lock_in_a_worker_is_a_lock_wait():
    text = """\
Thread 20 (idle): "MainThread"
    acquire (logging/__init__.py:917)
    handle (logging/__init__.py:968)
    info (logging/__init__.py:1489)
    __getitem__ (mydata.py:12)
    fetch (torch/utils/data/_utils/fetch.py:32)
"""
    assert classify(read(text).stacks[0], None).kind == "lock"


def test_the_main_process_waiting_on_its_workers_is_still_a_dataloader_wait():
    text = """\
Thread 20 (idle): "MainThread"
    wait (threading.py:331)
    get (queue.py:180)
    _try_get_data (torch/utils/data/dataloader.py:1133)
    _next_data (torch/utils/data/dataloader.py:1328)
    train (train.py:50)
"""
    assert classify(read(text).stacks[0], None).kind == "dataloader"
