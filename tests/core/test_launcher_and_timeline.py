"""How processes end in their launcher's words, and what a log's order and times say (playbooks/exits.py,
playbooks/timeline.py, probes/mpi_log.py, probes/app_log.py, and the normaliser's prefixes behind them).

The texts are real formats; most lines come from the real corpus (tests/fixtures/real/, named per test), with
hosts, pids and paths changed.
"""

from __future__ import annotations

import pytest

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.normalise import Normaliser
from hangdx.probes.reader import clean


def _verdict(tmp_path, text: str, name: str = "paste.txt"):
    p = tmp_path / name
    p.write_text(text)
    ev = evidence_from_paths([str(p)])
    return ev, engine.run(ev)


# -- the normaliser ----------------------------------------------------------------------------------------


def test_open_mpi_tag_output_prefixes_name_the_rank_even_repeated():
    # mpirun --tag-output, as in dataloader_stall__horovod-horovod-2255
    n = Normaliser()
    (ln,) = n.line(1, "[1,3]<stderr>:[1,3]<stderr>:Traceback (most recent call last):")
    assert (ln.rank, ln.text) == (3, "Traceback (most recent call last):")
    (ln,) = n.line(2, '[1,3]<stderr>:  File "/x/dataloader.py", line 779, in _try_get_data')
    assert ln.rank == 3 and ln.text.startswith('  File "')


def test_markdown_bold_around_a_pasted_line_goes():
    # dataloader_stall__open-mmlab-mmsegmentation-1356
    n = Normaliser()
    assert n.line(1, "**ERROR: Unexpected bus error encountered in worker.**")[0].text == (
        "ERROR: Unexpected bus error encountered in worker."
    )
    assert n.line(2, "**RuntimeError: x")[0].text == "RuntimeError: x"
    assert n.line(3, "2 ** 3")[0].text == "2 ** 3"


def test_a_shell_prompt_names_the_host_of_the_output_under_it_until_the_fence_closes():
    # gpu_fault__rwth-i6-returnn-1486
    lines = clean(
        (i, s.encode())
        for i, s in enumerate(
            [
                "```",
                "zeyer@cn-234 ~ % nvidia-smi",
                "Unable to determine the device handle for GPU0000:03:00.0: Unknown Error",
                "```",
                "after the fence",
                "[root@gpu-node-07 ~]# dmesg -T",
                "a kernel line",
                "me@login-01:~$ srun -N2 python train.py",
                "output of ranks on other nodes",
            ],
            1,
        )
    )
    hosts = {ln.text: ln.host for ln in lines}
    assert hosts["Unable to determine the device handle for GPU0000:03:00.0: Unknown Error"] == "cn-234"
    assert hosts["after the fence"] is None
    assert hosts["a kernel line"] == "gpu-node-07"
    assert hosts["output of ranks on other nodes"] is None  # a launcher's output comes from other hosts


def test_a_watchdog_message_wrapped_by_its_poster_is_joined_again():
    # conditional_collective__alan-turing-institute-autocast-381
    lines = clean(
        (i, s.encode())
        for i, s in enumerate(
            [
                "[Rank 0] Watchdog caught collective operation timeout:",
                "  WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000)",
                "  ran for 1800090 milliseconds before timing out.",
                "next line",
            ],
            1,
        )
    )
    assert [ln.text for ln in lines] == [
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=1800000) ran for 1800090 milliseconds before timing out.",
        "next line",
    ]


def test_an_unfinished_watchdog_line_does_not_swallow_unrelated_lines():
    lines = clean((i, s.encode()) for i, s in enumerate(["[Rank 0] Watchdog caught collective operation timeout:",
                                                          "Epoch 3 done"], 1))  # fmt: skip
    assert len(lines) == 2


# -- DataLoader workers ------------------------------------------------------------------------------------

_WORKER_KILLED = """\
[rank7]:   File "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py", line 1133, in _try_get_data
[rank7]:     data = self._data_queue.get(timeout=timeout)
[rank7]:   File "/opt/conda/lib/python3.10/site-packages/torch/utils/data/_utils/signal_handling.py", line 66, in handler
[rank7]:     _error_if_any_worker_fails()
[rank7]: RuntimeError: DataLoader worker (pid 742) is killed by signal: Killed.
"""


def test_a_dataloader_worker_killed_under_a_rank_is_that_rank_s_data_loading(tmp_path):
    # dataloader_stall__hpcaitech-Open-Sora-431
    _, v = _verdict(tmp_path, _WORKER_KILLED)
    rc = v.root_cause
    assert rc.category == "dataloader_stall" and rc.culprit.ranks == [7]
    assert "OOM killer" in rc.fix
    assert any("is killed by signal: Killed" in q.text for q in rc.evidence)


def test_a_worker_bus_error_points_at_shared_memory(tmp_path):
    # dataloader_stall__horovod-horovod-2255, Open MPI tags
    text = (
        "[1,2]<stderr>:ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient "
        "shared memory (shm).\n"
        "[1,2]<stderr>:RuntimeError: DataLoader worker (pid(s) 372) exited unexpectedly\n"
    )
    _, v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "dataloader_stall" and rc.culprit.ranks == [2]
    assert "/dev/shm" in rc.fix


# -- Open MPI ----------------------------------------------------------------------------------------------


def test_mpirun_names_the_rank_and_node_that_died(tmp_path):
    # rank_crashed__horovod-horovod-2053
    _, v = _verdict(
        tmp_path,
        "mpirun noticed that process rank 2 with PID 0 on node b44a5a6092b3 exited on signal 7 (Bus error).\n",
    )
    rc = v.root_cause
    assert rc.category == "rank_crashed"
    assert rc.culprit.ranks == [2] and rc.culprit.hosts == ["b44a5a6092b3"]


def test_a_redacted_node_name_is_no_host(tmp_path):
    # rank_crashed__horovod-horovod-469
    text = """\
-------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
-------------------------------------------------------
mpirun noticed that process rank 7 with PID 0 on node HOSTNAME exited on signal 9 (Killed).
"""
    _, v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [7] and rc.culprit.hosts == []
    assert "OOM killer" in rc.fix


def test_mpirun_s_process_name_and_exit_code(tmp_path):
    text = """\
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[35531,1],3]
  Exit code:    1
"""
    ev, v = _verdict(tmp_path, text)
    assert [(e.rank, e.fields["exit_code"]) for e in ev.events_of("mpi_rank_exit")] == [(3, 1)]
    assert v.root_cause.category == "rank_crashed" and v.root_cause.culprit.ranks == [3]


_BAR = "=" * 83


def test_hydra_bad_termination_with_a_rank_names_rank_and_node(tmp_path):
    # MPICH 4 / Intel MPI: RANK r PID p RUNNING AT host, then KILLED BY SIGNAL (pmodels/mpich mpiexec.c)
    text = f"""\
Error text: an illegal memory access was encountered

{_BAR}
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   RANK 5 PID 5490 RUNNING AT gn59
=   KILLED BY SIGNAL: 9 (Killed)
{_BAR}
"""
    ev, v = _verdict(tmp_path, text)
    (e,) = ev.events_of("mpi_rank_exit")
    assert (e.rank, e.host, e.pid, e.fields["signal"]) == (5, "gn59", 5490, "SIGKILL")
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == [5] and v.root_cause.culprit.hosts == ["gn59"]


def test_older_hydra_banner_names_only_the_node(tmp_path):
    # MPICH 3.x: PID p RUNNING AT host, EXIT CODE: n; indented as pasted inside a quote
    text = f"""\
    {_BAR}
    =   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
    =   PID 28488 RUNNING AT trainer-gpu-02
    =   EXIT CODE: 9
    =   CLEANING UP REMAINING PROCESSES
    =   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
    {_BAR}
"""
    ev, v = _verdict(tmp_path, text)
    (e,) = ev.events_of("mpi_rank_exit")
    assert (e.rank, e.host, e.fields["exit_code"]) == (None, "trainer-gpu-02", 9)
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == [] and v.root_cause.culprit.hosts == ["trainer-gpu-02"]


def test_a_pid_line_outside_hydra_s_banner_is_not_an_exit(tmp_path):
    ev = evidence_from_paths([str(_write(tmp_path, "=   PID 4242 RUNNING AT node-1\nall good\n"))])
    assert [e for e in ev.events_of("mpi_rank_exit") if not e.fields.get("signal_only")] == []
    assert engine.run(ev).root_cause.category != "rank_crashed"


def _write(tmp_path, text: str):
    p = tmp_path / "paste.txt"
    p.write_text(text)
    return p


_HEADLESS = """\
[rank{r}]:   File "recipes/train.py", line 981, in run_loop
[rank{r}]:     self.save_checkpoint(step)
[rank{r}]:   File "recipes/checkpointing.py", line 2011, in _create_dirs
[rank{r}]:     os.makedirs(directory, exist_ok=True)
[rank{r}]:   File "<frozen os>", line 225, in makedirs
[rank{r}]: {exc}
"""


@pytest.mark.parametrize(
    "r,exc",
    [
        (8, "FileExistsError: [Errno 17] File exists: '/ckpt/step_297'"),
        (0, "ValueError: bad shape"),
        (13, "KeyError: 'x'"),
    ],
)
def test_a_rank_s_traceback_pasted_without_its_header_is_that_rank_s_crash(tmp_path, r, exc):
    _, v = _verdict(tmp_path, _HEADLESS.format(r=r, exc=exc))
    assert v.root_cause.category == "rank_crashed" and v.root_cause.culprit.ranks == [r]


def test_frames_with_no_exception_line_are_no_crash(tmp_path):
    text = "\n".join(_HEADLESS.format(r=3, exc="").splitlines()[:-1]) + "\n"
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category != "rank_crashed"


_CUT = """\
{head}Traceback (most recent call last):
  File "train.py", line 36, in train
    for step, batch in enumerate(loader):
  File "/opt/conda/lib/python3.6/site-packages/torch/utils/data/dataloader.py", line {no}, in __next__
    idx, batch = self._get_batch()
  File "/opt/conda/lib/python3.6/site-packages/torch/utils/data/dataloader.py", line 480, in {inner}
    data = self.data_queue.get(timeout=timeout)
  File "/opt/conda/lib/python3.6/multiprocessing/queues.py", line 104, in get
    if not self._poll(timeout):
"""


@pytest.mark.parametrize("head,no,inner", [("^C", 545, "_try_get_batch"), ("", 631, "_try_get_data")])
def test_a_cut_interrupt_traceback_in_the_dataloader_queue_is_a_data_stall(tmp_path, head, no, inner):
    # the Ctrl-C's KeyboardInterrupt line lost by the paste: the frames still say where the process waited
    _, v = _verdict(tmp_path, _CUT.format(head=head, no=no, inner=inner))
    assert v.root_cause.category == "dataloader_stall"


def test_a_cut_traceback_that_ends_in_the_model_is_not_a_wait(tmp_path):
    text = _CUT.format(head="", no=545, inner="_try_get_batch").splitlines()[:4]
    text += ['  File "model.py", line 12, in forward', "    x = self.fc(x)"]
    ev = evidence_from_paths([str(_write(tmp_path, "\n".join(text) + "\n"))])
    assert ev.stacks == []


# -- torch elastic -----------------------------------------------------------------------------------------

_ELASTIC = """\
WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 2410413 closing signal SIGTERM
ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 2410412) of binary: /usr/bin/python
"""


def test_an_elastic_worker_killed_by_a_signal_is_a_crash_named_by_local_rank(tmp_path):
    # rank_crashed__hpcaitech-ColossalAI-3172
    _, v = _verdict(tmp_path, _ELASTIC)
    rc = v.root_cause
    # Nothing shows a second node: the local rank is the global rank (group_rank * local_world_size + local_rank),
    # and the summary says it assumed so.
    assert rc.category == "rank_crashed" and rc.culprit.ranks == [0]
    assert "local rank 0 (pid 2410412)" in rc.summary and "SIGKILL" in rc.summary
    assert "local rank is global rank" in rc.summary


def test_a_worker_the_watchdog_aborted_is_not_called_a_crash(tmp_path):
    text = (
        "[rank0]:[E1122 01:48:50.682679688 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 "
        "milliseconds before timing out.\n"
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -6) local_rank: 0 (pid: 11) of "
        "binary: /usr/bin/python\n"
    )
    _, v = _verdict(tmp_path, text)
    assert all(f.playbook != "local_rank_killed" for f in v.findings)


# -- rendezvous, GPU ---------------------------------------------------------------------------------------


def test_a_store_address_no_node_can_route_to_is_a_comm_init_failure_naming_it(tmp_path):
    # comm_init_failure__huggingface-accelerate-2468
    text = (
        'trainer-2:   File "/usr/lib/python3/dist-packages/torch/distributed/rendezvous.py", line 174, in '
        "_create_c10d_store\n"
        "trainer-2:     return TCPStore(\n"
        "trainer-2: torch.distributed.DistNetworkError: The client socket has failed to connect to any network "
        "address of (10.1.2.3, 29500). The client socket has failed to connect to 10.1.2.3:29500 (errno: 113 - "
        "No route to host).\n"
    )
    _, v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "comm_init_failure" and rc.culprit.hosts == ["trainer-2"]
    assert "10.1.2.3:29500" in rc.fix and "No route to host" in rc.summary


def test_an_uncorrectable_ecc_error_is_a_gpu_fault_with_no_rank_named(tmp_path):
    # gpu_fault__jade-hpc-gpu-jade-hpc-gpu.github.io-194
    text = (
        "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
        "might be incorrect.\n"
    )
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "gpu_fault"


def test_an_uncorrectable_nvlink_error_is_a_gpu_fault(tmp_path):
    text = "[rank3]: RuntimeError: CUDA error: uncorrectable NVLink error was detected during the execution\n"
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "gpu_fault" and v.root_cause.culprit.ranks == [3]


# -- checkpoints and timing --------------------------------------------------------------------------------


def test_an_object_storage_transfer_stall_at_a_checkpoint_is_io_stall(tmp_path):
    # io_stall__marin-community-levanter-578
    text = """\
W0000 00:00:1715498963.019816  583764 curl_transport.cc:444] Error [28]=Timeout was reached in curl operation
Operation too slow. Less than 1024 bytes/sec transferred the last 60 seconds
2024-05-12T07:29:27 - 0 - levanter.checkpoint - checkpoint.py:293 - INFO :: Saved checkpoint to gs://bucket/run/step-300
"""
    _, v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "io_stall" and rc.confidence >= 0.75
    assert "gs://bucket/run/step-300" in rc.summary and "TENSORSTORE_CURL_LOW_SPEED" in rc.fix


_SAVE = "2026-02-18 10:28:25,496 - root - INFO - Saving latest checkpoint model trained for 3 epochs\n"
_TIMEOUT = (
    "[rank7]:[E218 {t} ProcessGroupNCCL.cpp:632] [Rank 7] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=1512677, OpType=ALLREDUCE, NumelIn=306176, NumelOut=306176, Timeout(ms)=1200000) ran for "
    "1200027 milliseconds before timing out.\n"
)


def test_a_collective_that_started_at_the_last_save_line_says_the_job_stopped_at_the_save(tmp_path):
    # io_stall__ai2cm-ace-851
    _, v = _verdict(tmp_path, _SAVE + _TIMEOUT.format(t="10:48:25.033625188"))
    assert v.root_cause.category == "io_stall" and v.root_cause.confidence <= 0.6


def test_a_save_long_before_the_collective_started_says_nothing(tmp_path):
    _, v = _verdict(tmp_path, _SAVE + _TIMEOUT.format(t="11:30:00.000000000"))
    assert all(f.playbook != "stopped_at_save" for f in v.findings)


def test_a_save_followed_by_more_progress_says_nothing(tmp_path):
    more = "2026-02-18 10:28:26,000 - root - INFO - Saved checkpoint to /ckpt/latest.pt\n"
    _, v = _verdict(tmp_path, _SAVE + more + _TIMEOUT.format(t="10:48:25.033625188"))
    assert all(f.playbook != "stopped_at_save" for f in v.findings)


def test_one_rank_timing_out_after_training_finished_issued_an_extra_collective(tmp_path):
    # conditional_collective__alan-turing-institute-autocast-381
    text = """\
`Trainer.fit` stopped: `max_epochs=20` reached.
[Rank 0] Watchdog caught collective operation timeout:
  WorkNCCL(SeqNum=88, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000)
  ran for 1800090 milliseconds before timing out.
"""
    _, v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "conditional_collective" and rc.culprit.ranks == [0]


def test_a_timeout_before_training_finished_is_not_read_as_after_it(tmp_path):
    text = (
        _TIMEOUT.format(t="10:48:25.033625188")
        + "`Trainer.fit` stopped: `max_epochs=20` reached.\n"
        + _TIMEOUT.format(t="10:49:25.033625188").replace("SeqNum=1512677", "SeqNum=1512678")
    )
    _, v = _verdict(tmp_path, text)
    assert all(f.playbook != "after_finish" for f in v.findings)


def test_vllm_and_sglang_worker_prefixes_name_the_rank_that_printed():
    # vLLM's worker prefixes (vllm _add_prefix) and SGLang's log prefix, as printed in public reports.
    n = Normaliser()
    (ln,) = n.line(
        1,
        "(VllmWorker rank=1 pid=8700) ERROR 06-28 06:20:15 [multiproc_executor.py:487] Traceback (most recent call last):",
    )
    assert (ln.rank, ln.pid) == (1, 8700) and ln.text.startswith("ERROR 06-28")
    (ln,) = n.line(
        2,
        "(EngineCore_1 pid=75299) (VllmWorker rank=1 pid=75322) ERROR 05-16 16:35:18 [multiproc_executor.py:470] x",
    )
    assert (ln.rank, ln.pid) == (1, 75322)  # the innermost process printed it
    (ln,) = n.line(
        3,
        "(Worker_TP1 pid=1163) INFO 10-10 11:32:51 [multiproc_executor.py:558] Parent process exited, terminating worker",
    )
    assert (ln.rank, ln.pid) == (1, 1163)
    (ln,) = n.line(4, "(Worker_PP1_TP0 pid=88241) ERROR 08-14 11:24:36 [multiproc_executor.py:1232] x")
    assert (ln.rank, ln.pid) == (None, 88241)  # a pipeline stage's TP rank is not the global rank
    (ln,) = n.line(5, "[2025-02-23 06:02:12 TP3] sglang is using nccl==2.21.5")
    assert ln.rank == 3 and ln.text.startswith("[2025-02-23 06:02:12 TP3]")  # the time stays for the timeline
    (ln,) = n.line(6, "[2025-02-23 06:02:12 DP1 TP3] sglang is using nccl==2.21.5")
    assert ln.rank is None


def test_a_vllm_worker_that_raised_is_the_rank_that_died(tmp_path):
    head = "(VllmWorker rank=1 pid=191128) ERROR 05-28 18:58:32 [multiproc_executor.py:522] "
    text = "".join(
        head + ln + "\n"
        for ln in (
            "WorkerProc hit an exception.",
            "Traceback (most recent call last):",
            '  File "/venv/lib/python3.10/site-packages/vllm/v1/worker/gpu_model_runner.py", line 748, in execute_model',
            "    hidden = self.model(input_ids)",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        )
    )
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "rank_crashed"
    assert v.root_cause.culprit.ranks == [1]


def test_nccls_device_prefix_is_not_a_log_viewers_line_number():
    # NVIDIA/nccl #582: NCCL lines that kept only their `[dev] ` prefix; a viewer's gutter still counts up.
    n = Normaliser()
    (ln,) = n.line(
        1, "[10] ./third_party/gpus/nccl/src/include/alloc.h:58 NCCL WARN Cuda failure 'out of memory'"
    )
    assert ln.text.startswith("[10] ./third_party")
    (ln,) = n.line(2, "[10] NCCL INFO third_party/gpus/nccl/src/transport/p2p.cc:164 -> 1")
    assert ln.text.startswith("[10] NCCL INFO")
    g = Normaliser()
    assert [
        ln.text for i, t in enumerate(("[1743] a line", "[1744] the next"), 1) for ln in g.line(i, t)
    ] == [
        "a line",
        "the next",
    ]


# -- a heading that names a rank ---------------------------------------------------------------------------


def test_a_heading_names_the_rank_of_the_unprefixed_lines_under_it():
    n = Normaliser()
    out = [n.line(i, s) for i, s in enumerate(["**Rank 1 (waiting):**", "```", "barrier (x.py:3)", "```"], 1)]
    assert [ln.rank for lines in out for ln in lines] == [1, 1]
    assert n.line(5, "Rank 0:")[0].rank == 0
    assert n.line(6, "  wait (threading.py:306)")[0].rank == 0
    # A line with its own prefix keeps it, and the heading ends there.
    assert n.line(7, "[rank3]: RuntimeError: x")[0].rank == 3
    assert n.line(8, "an unprefixed line")[0].rank is None
    # A heading over one of a rank's worker processes names no rank: the worker is not the rank's process.
    n.line(9, "Rank 2:")
    assert n.line(10, "**Rank 2 worker (one of 8):**")[0].rank is None
    assert n.line(11, "fetch (x.py:1)")[0].rank is None
    # Not headings: a sentence, a rank prefix with a message after it.
    m = Normaliser()
    assert m.line(1, "Rank 0 uses device 0 [0x05] Tesla M40 24GB")[0].rank is None
    assert m.line(2, "after it")[0].rank is None


def test_a_prose_heading_over_a_dump_names_its_rank():
    n = Normaliser()
    # How people head what they paste (pytorch/pytorch#87995: `The stack for rank0:` over a py-spy dump).
    for i, (head, rank) in enumerate(
        [("The stack for rank0:", 0), ("py-spy dump of rank 3:", 3), ("RANK 2 STACK:", 2)]
    ):
        n.line(10 * i + 1, head)
        assert n.line(10 * i + 2, "    wait (threading.py:302)")[0].rank == rank
    # Not headings: two ranks, another number beside the rank, a worker of the rank, a line that does not end
    # with a colon.
    for line in (
        "Stacks of rank 2 and rank 3:",
        "step 3 on rank 1:",
        "Stack of rank 0 worker:",
        "rank 1 is stuck here",
        "Timed out waiting for rank 5:",  # a message, not a heading: it heads no stack, trace or dump
        "INFO train.py: waiting for the dump of rank 0:",
        "Error on rank 3: RuntimeError:",
    ):
        m = Normaliser()
        m.line(1, line)
        assert m.line(2, "    wait (threading.py:302)")[0].rank is None, line


def test_stacks_under_rank_headings_flush_left_are_each_rank_s(tmp_path):
    # py-spy frames retyped without indentation under a heading per rank: one rank in a barrier, the other
    # preparing its data with Hugging Face datasets' map (the shape of
    # dataloader_stall__cliangyu-ttcc-rl-session-journal-20260522).
    text = (
        "**Rank 1 (waiting):**\n```\nbarrier (torch/distributed/distributed_c10d.py:5030)\n"
        "main_first (app/utils.py:66)\ntrain (app/train.py:10)\n```\n\n"
        "**Rank 0:**\n```\n_recv (multiprocess/connection.py:398)\n"
        "iflatmap_unordered (datasets/utils/py_utils.py:610)\nmap (datasets/arrow_dataset.py:3623)\n"
        "prepare (app/data.py:20)\n```\n"
    )
    ev, v = _verdict(tmp_path, text)
    assert sorted(d.rank for d in ev.stacks) == [0, 1]
    assert v.root_cause.category == "dataloader_stall", v.root_cause.summary
    assert v.root_cause.culprit.ranks == [0]


# -- per-rank loop lengths ---------------------------------------------------------------------------------


def test_ranks_printing_different_numbers_of_batches_are_uneven_data(tmp_path):
    text = "".join(f"Rank = {r}, Number of batches {8 if r == 5 else 6}\n" for r in range(8))
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "conditional_collective", v.root_cause.summary
    assert v.root_cause.culprit.ranks == [5]
    # torchrun's prefix names the rank as well as the words do.
    text = "".join(f"[rank{r}]: len(train_loader) = {100 + r % 2}\n" for r in range(4))
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "conditional_collective" and v.root_cause.culprit.ranks == []


def test_ranks_printing_the_same_number_of_batches_are_no_finding(tmp_path):
    ev, v = _verdict(tmp_path, "".join(f"Rank = {r}, Number of batches 6\n" for r in range(4)))
    assert len(ev.events_of("data_length")) == 4
    assert v.root_cause.category != "conditional_collective"


# -- whose process: a rank learnt from the same process's other lines, a process group's own rank ----------------


def test_a_crash_report_naming_only_its_pid_gets_the_rank_its_process_s_other_lines_name(tmp_path):
    text = (
        "(WorkerDict pid=18980) [rank4]:[E402 16:49:38.988158820 ProcessGroupNCCL.cpp:1515] [PG 97 Rank 0] Process "
        "group watchdog thread terminated with exception: CUDA error: an illegal memory access was encountered\n"
        "(WorkerDict pid=18980) Fatal Python error: Aborted\n"
        "(WorkerDict pid=18980) \n"
        "(WorkerDict pid=18980) Thread 0x00007fc8b4ff9640 (most recent call first):\n"
        '(WorkerDict pid=18980)   File "/x/threading.py", line 324 in wait\n'
    )
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "rank_crashed", v.root_cause.summary
    assert v.root_cause.culprit.ranks == [4]


def test_a_process_group_s_own_rank_is_not_the_job_s_rank(tmp_path):
    # ProcessGroupNCCL's prefix prints the rank within its group: rank 0 of PG 97 is not global rank 0.
    line = (
        "[2025-04-02 16:49:38,666 E 18980 20767] logging.cc:97: Unhandled exception: N3c1016DistBackendErrorE. what(): "
        "[PG {pg} Rank 3] Process group watchdog thread terminated with exception: CUDA error: an illegal memory "
        "access was encountered\n"
    )
    ev, _ = _verdict(tmp_path, line.format(pg="97"))
    assert all(e.rank is None for e in ev.events_of("cuda_error"))
    ev, _ = _verdict(tmp_path, line.format(pg="0"))
    assert {e.rank for e in ev.events_of("cuda_error")} == {3}


def test_ray_s_oom_kill_names_the_node_its_message_goes_on_with(tmp_path):
    text = (
        "    output = ray.get(output)\n"
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
        "Memory on the node (IP: 10.1.2.3, ID: 02f82f803ebbe53896582a02e58afee99633c7736f7e04e19cfe466e) where the "
        "task (actor ID: 35401eb04028d69250016be001000000, name=Worker.__init__, pid=827684, memory used=43.35GB) "
        "was running was 382.59GB / 400.00GB (0.956471), which exceeds the memory usage threshold of 0.95.\n"
    )
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "rank_crashed", v.root_cause.summary
    assert v.root_cause.culprit.hosts == ["10.1.2.3"]


def test_nccl_s_interface_list_broken_before_each_entry_is_one_line_again():
    lines = clean(
        (i, s.encode())
        for i, s in enumerate(
            [
                "gpu1:1234:1234 [0] NCCL INFO NET/Socket : Using",
                "[0]bond0:192.168.1.161<0>",
                "[1]br-05ab815fa14e:172.19.0.1<0>",
                "[2]veth6163fba:fe80::b878:6cff:fe52:abe2%veth6163fba<0> ",
                "gpu1:1234:1234 [0] NCCL INFO Using network Socket",
                "gpu1:1234:1234 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>",
                "[rank0]: not an interface",
            ],
            1,
        )
    )
    texts = [ln.text for ln in lines]
    assert texts[0].endswith(
        "NET/Socket : Using [0]bond0:192.168.1.161<0> [1]br-05ab815fa14e:172.19.0.1<0> "
        "[2]veth6163fba:fe80::b878:6cff:fe52:abe2%veth6163fba<0>"
    )
    assert len(lines) == 4 and lines[-1].text == "not an interface" and lines[-1].rank == 0


def test_the_worker_a_ray_task_error_names_is_where_the_exception_under_it_happened(tmp_path):
    text = (
        "ray.exceptions.RayTaskError(RuntimeError): ray::TaskRunner.run() (pid=9153, ip=10.0.0.1, actor_id=42e1)\n"
        '  File "/x/main.py", line 10, in run\n'
        "ray.exceptions.RayTaskError(RuntimeError): ray::Worker.init_model() (pid=11755, ip=10.0.0.7, actor_id=3aa4)\n"
        "Traceback (most recent call last):\n"
        '  File "/x/workers.py", line 20, in init_model\n'
        "    loop = asyncio.get_event_loop()\n"
        "RuntimeError: There is no current event loop in thread 'MainThread'.\n"
    )
    _, v = _verdict(tmp_path, text)
    assert v.root_cause.category == "rank_crashed", v.root_cause.summary
    assert v.root_cause.culprit.hosts == ["10.0.0.7"]


def test_a_traceback_fragment_whose_first_frame_lost_its_indent_is_still_read(tmp_path):
    text = (
        'File "/app/torchtitan/distributed/utils.py", line 423, in _clip_grad_norm_with_ep\n'
        "    ).full_tensor()\n"
        "      ^^^^^^^^^^^\n"
        "AttributeError: 'Tensor' object has no attribute 'full_tensor'\n"
    )
    ev, v = _verdict(tmp_path, text)
    [exc] = ev.events_of("exception")
    assert exc.fields["exc_type"] == "AttributeError"
    assert v.root_cause.category == "rank_crashed", v.root_cause.summary
