"""The catalogue as the reader's floor: shapes the region parsers do not know are still read, and weighed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hangdx.playbooks import engine
from hangdx.probes import catalogue, reader
from hangdx.probes.model import Evidence, Source

ENGINES = ["hyperscan", "python"]


def _read(text: str, monkeypatch, how: str, name: str = "paste.txt") -> Evidence:
    cat = catalogue.load(how) if how == "python" else catalogue.load()
    monkeypatch.setattr(catalogue, "load", lambda engine=None: cat)
    ev = Evidence()
    reader.read_text([text.encode()], Source(name), ev)
    return ev


def _top(ev: Evidence):
    return engine.run(ev).root_cause


@pytest.mark.parametrize("how", ENGINES)
def test_ib_async_event_from_a_shortened_host_names_the_host(monkeypatch, how):
    ev = _read("...-48:34050:34121 [0] NCCL WARN NET/IB : Got async event : port error\n", monkeypatch, how)
    top = _top(ev)
    assert top.category == "network_fault"
    assert any("48" in h for h in top.culprit.hosts)


@pytest.mark.parametrize("how", ENGINES)
def test_kernel_oom_trace_with_dmesg_stamps_is_a_crash_of_that_process(monkeypatch, how):
    text = (
        "[ 1234.567] python invoked oom-killer: gfp_mask=0x100cca(GFP_HIGHUSER_MOVABLE), order=0\n"
        "[ 1234.568] Call Trace:\n[ 1234.569]  dump_stack+0x6d/0x8b\n"
        "[ 1234.600] Out of memory: Killed process 4242 (python) total-vm:1234kB\n"
    )
    top = _top(_read(text, monkeypatch, how))
    assert top.category == "rank_crashed"
    assert "4242" in " ".join(top.culprit.processes)


@pytest.mark.parametrize("how", ENGINES)
def test_watchdog_wrapped_inside_worknccl_is_read_once_and_says_how_to_confirm(monkeypatch, how):
    text = (
        "[rank3]:[E515 18:36:47.341808597 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation"
        " timeout: WorkNC\nCL(SeqNum=241, OpType=ALLREDUCE, NumelIn=6, NumelOut=6, Timeout(ms)=600000) ran for"
        " 600086 milliseconds before timing out.\n"
    )
    ev = _read(text, monkeypatch, how)
    timeouts = ev.events_of("watchdog_timeout")
    assert len(timeouts) == 1 and timeouts[0].rank == 3 and timeouts[0].fields["seq"] == 241
    verdict = engine.run(ev)
    top = verdict.root_cause
    assert (
        top.category == "unknown" and top.confidence > 0.1
    )  # a lone timeout names the victim, not the cause
    assert any("py-spy dump" in s for s in top.next_steps)


@pytest.mark.parametrize("how", ENGINES)
def test_gloo_barrier_after_a_progress_bar_names_the_absent_rank(monkeypatch, how):
    text = "Epoch 1:  45%|####5     | 450/1000 [01:23<01:40,  5.4it/s]RuntimeError: Rank 1 failed to pass monitoredBarrier in 10000 ms\n"
    top = _top(_read(text, monkeypatch, how))
    assert top.category == "conditional_collective" and top.culprit.ranks == [1]


@pytest.mark.parametrize("how", ENGINES)
def test_a_line_a_parser_read_is_not_counted_twice(monkeypatch, how):
    text = (
        "[rank3]:[E515 18:36:47.341808597 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=241, OpType=ALLREDUCE, NumelIn=6, NumelOut=6, Timeout(ms)=600000) ran for 600086 "
        "milliseconds before timing out.\n"
    )
    ev = _read(text, monkeypatch, how)
    assert len(ev.events_of("watchdog_timeout")) == 1
    assert ev.events_of("watchdog_timeout")[0].fields["signal_row"]


def test_decisive_hardware_line_beats_the_timeouts_it_caused(monkeypatch):
    text = (
        "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL("
        "SeqNum=9, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600100 milliseconds before timing out.\n"
        "node-7: [ 88.1] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
    )
    top = _top(_read(text, monkeypatch, "hyperscan"))
    assert top.category == "gpu_fault"
    assert "node-7" in top.culprit.hosts


def test_a_row_line_in_the_middle_of_a_big_log_is_kept(monkeypatch):
    filler = "".join(
        f"step {i} loss 0.5 lr 0.0001 throughput fine\n" for i in range(reader.HEAD_LINES + 5000)
    )
    after = "".join(f"step {i} loss 0.5 lr 0.0001 throughput fine\n" for i in range(reader.TAIL_LINES + 5000))
    line = "[ 5000.000000] python[4242]: segfault at 0 ip 00007f1234567890 sp 00007ffc12345678 in libc.so.6\n"
    data = (filler + line + after).encode()
    cat = catalogue.load()
    monkeypatch.setattr(catalogue, "load", lambda engine=None: cat)
    ev = Evidence()
    step = 1 << 20
    reader.read_text([data[i : i + step] for i in range(0, len(data), step)], Source("big.log"), ev)
    assert [e.pid for e in ev.events_of("segfault")] == [4242]


def _analyze(tmp_path, text: str) -> int:
    f = tmp_path / "paste.txt"
    f.write_text(text)
    return subprocess.run([sys.executable, "-m", "hangdx", "analyze", str(f)], capture_output=True).returncode


def test_exit_2_only_when_nothing_is_read(tmp_path):
    assert _analyze(tmp_path, "hello\nthis is a recipe for bread\n") == 2
    assert _analyze(tmp_path, "...-48:34050:34121 [0] NCCL WARN NET/IB : Got async event : port error\n") == 0


NEW_KINDS = """
- id: test.framework.step_line
  emitter: SomeFramework
  source: someone/framework src/loop.py
  pattern: 'finished training step (?P<step>\\d{1,9})'
  fields: [step]
  event: step_counter
  category: null
  strength: context
  meaning: a progress line without the fields the uneven-loops playbook reads
  examples: ['[rank 0] finished training step 12']
- id: test.kernel.soft_lockup
  emitter: Linux kernel
  source: torvalds/linux kernel/watchdog.c
  pattern: 'watchdog: BUG: soft lockup - CPU#(?P<cpu>\\d{1,4}) stuck for (?P<timeout_s>\\d{1,6})s'
  fields: [cpu, timeout_s]
  event: soft_lockup
  category: io_stall
  strength: suggestive
  meaning: A CPU ran kernel code without scheduling for that long.
  examples: ['watchdog: BUG: soft lockup - CPU#12 stuck for 23s! [python:4242]']
"""


def test_rows_of_kinds_merged_later_are_read_and_weighed_without_crashing(monkeypatch):
    rows = catalogue.load().rows + catalogue.load_rows([("test.yaml", NEW_KINDS)])
    cat = catalogue.Catalogue(rows)
    monkeypatch.setattr(catalogue, "load", lambda engine=None: cat)
    text = (
        "[rank0]: finished training step 12\n[rank1]: finished training step 11\n"
        "node-4: [ 99.1] watchdog: BUG: soft lockup - CPU#12 stuck for 23s! [python:4242]\n"
    )
    ev = Evidence()
    reader.read_text([text.encode()], Source("paste.txt"), ev)
    # A kind whose playbook needs fields the row lacks is kept aside, not fed to that playbook.
    assert not ev.events_of("step_counter") and len(ev.events_of("signal")) == 2
    verdict = engine.run(ev)
    assert not [g for g in verdict.gaps if "playbook" in g]
    top = verdict.root_cause
    assert top.category == "io_stall" and top.culprit.hosts == ["node-4"]


def _random_log(seed: int, lines: int) -> bytes:
    import random

    rnd = random.Random(seed)
    examples = [r.examples[0] for r in catalogue.load().rows]
    out = []
    for i in range(lines):
        x = rnd.random()
        if x < 0.002:
            out.append(rnd.choice(examples))
        elif x < 0.004:
            out.append(f"[rank{i % 8}]: RuntimeError: something failed at step {i}")
        elif x < 0.006 and i < lines // 3:  # collective lines in the first third only: later pieces have none
            out.append(f"node:{i}:{i} [0] NCCL INFO AllReduce: opCount {i:x} sendbuff 0x1 count 8 comm 0xabc")
        else:
            out.append(f"[rank{i % 8}]: step {i} loss {rnd.random():.4f} lr 0.0001")
    return ("\n".join(out) + "\n").encode()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_sparse_piece_path_keeps_exactly_what_the_line_path_keeps(seed, monkeypatch):
    data = _random_log(seed, 120_000)
    cat = catalogue.load()
    calls = []
    real = reader.Keeper._sparse
    monkeypatch.setattr(reader.Keeper, "_sparse", lambda self, *a: calls.append(1) or real(self, *a))
    got = []
    for sparse in (True, False):
        k = reader.Keeper(cat)
        k.sparse = sparse
        for i in range(0, len(data), 1 << 20):
            k.feed(data[i : i + (1 << 20)])
        got.append((k.close(), k.dropped, k.lineno, k.collectives))
    assert calls, "the sparse path was not taken"
    assert got[0] == got[1]
    kept = {ln for _, ln in got[0][0]}
    for ln in data.split(b"\n"):
        if b"failed at step" in ln or any(e.encode() == ln for e in [r.examples[0] for r in cat.rows]):
            assert ln in kept


def test_a_line_that_settles_nothing_still_says_what_was_seen(monkeypatch):
    text = "include/shm.h:28 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-x: No space left on device\n"
    top = _top(_read(text, monkeypatch, "hyperscan"))
    assert top.category == "unknown" and "No space left on device" in top.summary


def test_the_pure_python_path_is_said_once_in_the_notes(monkeypatch):
    ev = _read(
        "...-48:34050:34121 [0] NCCL WARN NET/IB : Got async event : port error\n", monkeypatch, "python"
    )
    notes = engine.run(ev).notes
    assert len([n for n in notes if "pure-Python" in n]) == 1


def test_a_message_row_wins_over_the_prefix_row_on_its_line():
    from hangdx.probes import signals

    cat = catalogue.load()
    line = "[PG ID 0 PG GUID 0(default_pg) Rank 1] Starting to destroy process group, flushing operations."
    found = cat.match_line(line)
    assert {"torch_pgnccl_log_prefix_desc", "torch_nccl_destroy_flushing"} <= {r.id for r, _ in found}
    assert signals._best(found)[0].id == "torch_nccl_destroy_flushing"


@pytest.mark.parametrize("how", ENGINES)
def test_a_message_told_over_lines_keeps_what_its_strongest_line_says(monkeypatch, how):
    # c10d's C10D_NCCL_CHECK: the first line and getNcclErrorDetailStr's class name no cause; the CUDA error NCCL
    # recorded as its last error does (the shape of NovaSky-AI/SkyRL#108: GPUs without peer-to-peer access).
    head = (
        "torch.distributed.DistBackendError: NCCL error in: /opt/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
        "ncclUnhandledCudaError: Call to CUDA function failed.\n"
    )
    assert _top(_read(head, monkeypatch, how)).category == "unknown"  # the class alone: a CUDA call failed
    text = head + "Last error:\nCuda failure 217 'peer access is not supported between these two devices'\n"
    assert _top(_read(text, monkeypatch, how)).category == "comm_init_failure"
    oom = head + "Last error:\nCuda failure 'out of memory'\n"
    assert _top(_read(oom, monkeypatch, how)).category == "comm_init_failure"  # NCCL's buffers, not the GPU
    ecc = head + "Last error:\nCuda failure 'uncorrectable ECC error encountered'\n"
    assert _top(_read(ecc, monkeypatch, how)).category == "gpu_fault"


@pytest.mark.parametrize("how", ENGINES)
@pytest.mark.parametrize(
    "line, category",
    [
        (
            "torch.multiprocessing.spawn.ProcessExitedException: process 2 terminated with signal SIGKILL",
            "rank_crashed",
        ),
        (
            "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGSEGV",
            "rank_crashed",
        ),
        (
            "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with signal SIGABRT",
            "unknown",
        ),
        (
            "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGTERM",
            "unknown",
        ),
    ],
)
def test_spawn_reads_how_the_first_process_ended_as_its_source_means_it(monkeypatch, how, line, category):
    top = _top(_read(line + "\n", monkeypatch, how))
    assert top.category == category
    if category == "rank_crashed":
        assert top.culprit.ranks == [int(line.split("process ")[1].split()[0])]


@pytest.mark.parametrize("how", ENGINES)
def test_torchrun_table_signal_line_sigkill_is_a_crash_sigabrt_settles_nothing(monkeypatch, how):
    killed = "  traceback : Signal 9 (SIGKILL) received by PID 2117\n"
    assert _top(_read(killed, monkeypatch, how)).category == "rank_crashed"
    aborted = "  traceback : Signal 6 (SIGABRT) received by PID 4412\n"
    assert _top(_read(aborted, monkeypatch, how)).category == "unknown"


@pytest.mark.parametrize("how", ENGINES)
def test_a_decisive_line_that_names_nobody_takes_the_name_a_line_of_the_same_death_gives(monkeypatch, how):
    # slurmstepd says how the task died (the OOM killer) and names no node; srun's own line for the same step says
    # which node's task was killed. Both in Slurm's formats (src/srun/srun_job.c, src/plugins/task/cgroup).
    text = (
        "srun: error: gpu-node-07: task 3: Killed\n"
        "srun: launch/slurm: _step_signal: Terminating StepId=123456.0\n"
        "slurmstepd: error: Detected 1 oom_kill event in StepId=123456.0. Some of the step tasks have been OOM "
        "Killed.\n"
    )
    top = _top(_read(text, monkeypatch, how))
    assert top.category == "rank_crashed" and top.confidence >= 0.8  # the decisive line's weight
    assert top.culprit.hosts == ["gpu-node-07"]
    assert any("task 3: Killed" in q.text for q in top.evidence)
