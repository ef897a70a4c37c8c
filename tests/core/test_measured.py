"""Measurements people paste: nccl-tests runs and results per node set, timings per rank, pipeline schedules.

The texts are in the tools' real formats. nccl-tests output: the layout all_reduce_perf prints (nccl-tests 2.x,
as quoted in public setup notes, e.g. a 2-node V100 run `mpirun -np 2 --host sw53,sw54 all_reduce_perf`); the
node-set table and the per-rank lines are the shapes of NVIDIA/nccl-tests#106 and pytorch/pytorch#59433; the
timing table is xtuner's log-analysis output (InternLM/xtuner#1790); the action lists are torch pipelining's
`_Action` reprs (pytorch/pytorch#172668 and torch's own SEND_F/RECV_B spelling). Host names and numbers are
changed from the corpus cases, so that the rules are shown to be general.
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.playbooks.verdict import Verdict
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.model import Evidence


def _ev(tmp_path, text: str) -> Evidence:
    p = tmp_path / "paste.txt"
    p.write_text(text)
    return evidence_from_paths([str(p)])


def _verdict(tmp_path, text: str) -> Verdict:
    return engine.run(_ev(tmp_path, text))


def _run(hosts: list[str], busbw: float, wrong: int = 0, gpus: int = 1) -> str:
    ranks = "\n".join(
        f"#  Rank {i:2d} Group  0 Pid {40000 + i:6d} on {h:>10} device {g:2d} [0x{0xB1 + g:02x}] Tesla V100-PCIE-32GB"
        for i, (h, g) in enumerate((h, g) for h in hosts for g in range(gpus))
    )
    big = f"   134217728      33554432     float     sum      -1   2145.3   62.56  {busbw:6.2f}  {wrong:5d}   2138.1   62.78  {busbw:6.2f}      0"
    return f"""# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
{ranks}
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    17.39    0.00    0.00      0    16.26    0.00    0.00      0
          16             4     float     sum      -1    17.45    0.00    0.00      0    26.12    0.00    0.00      0
{big}
# Out of bounds values : 0 OK
# Avg bus bandwidth    : {busbw:.4f}
#
"""


# -- nccl-tests ----------------------------------------------------------------------------------------------


def test_an_all_reduce_perf_run_is_read_with_its_hosts_devices_and_bandwidth(tmp_path):
    ev = _ev(tmp_path, _run(["sw53", "sw54"], 1.1533))
    (run,) = ev.events_of("nccl_tests_run")
    assert run.fields["hosts"] == ["sw53", "sw54"]
    assert run.fields["avg_busbw"] == 1.1533
    assert run.fields["wrong"] == 0 and run.fields["rows"] == 3
    assert (
        run.fields["ranks"][1]["host"] == "sw54" and run.fields["ranks"][1]["gpu"] == "Tesla V100-PCIE-32GB"
    )
    assert "Avg bus bandwidth" in run.quote.text
    assert "nccl-tests" in " ".join(ev.reads)


def test_runs_over_node_pairs_name_the_node_common_to_the_slow_pairs(tmp_path):
    text = "".join(
        _run(pair, bw)
        for pair, bw in [
            (["gpu-a07", "gpu-a11"], 21.9),
            (["gpu-a11", "gpu-a12"], 44.0),
            (["gpu-a07", "gpu-a15"], 22.3),
            (["gpu-a15", "gpu-a16"], 45.2),
        ]
    )
    v = _verdict(tmp_path, text)
    rc = v.root_cause
    assert rc.category == "straggler" and rc.culprit.hosts == ["gpu-a07"], rc.summary
    assert v.status == "progressing"
    assert any("21.9" in q.text for q in rc.evidence)


def test_open_mpi_tagged_output_is_read(tmp_path):
    text = "".join(f"[1,0]<stdout>:{ln}\n" for ln in _run(["sw53", "sw54"], 3.12).splitlines())
    (run,) = _ev(tmp_path, text).events_of("nccl_tests_run")
    assert run.fields["avg_busbw"] == 3.12 and run.fields["hosts"] == ["sw53", "sw54"]


def test_a_table_of_results_per_node_pair_names_the_slow_node(tmp_path):
    text = """```
node-r1c03,node-r1c09     12.01
node-r1c04,node-r1c05     23.75
node-r1c09,node-r2c01     23.40   # other rack
node-r1c03,node-r1c04     11.96
```
"""
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.hosts == ["node-r1c03"], rc.summary
    assert "node-r1c03" in rc.summary


def test_a_slow_pair_that_no_fast_pair_clears_names_nobody(tmp_path):
    text = "node01,node02  40.1\nnode03,node04  88.0\nnode05,node06  87.2\n"
    findings = [f for f in _verdict(tmp_path, text).findings if f.category == "straggler"]
    assert not findings


def test_wrong_values_on_one_node_are_a_gpu_fault(tmp_path):
    rc = _verdict(tmp_path, _run(["dgx-07"], 180.0, wrong=3, gpus=8)).root_cause
    assert rc.category == "gpu_fault" and rc.culprit.hosts == ["dgx-07"], rc.summary
    assert "3 wrong values" in rc.summary
    assert any(q.text.strip().startswith("134217728") for q in rc.evidence)


def test_wrong_values_between_nodes_are_a_network_fault_on_the_node_clean_runs_do_not_clear(tmp_path):
    text = _run(["n1", "n2"], 40.0, wrong=7) + _run(["n2", "n3"], 40.0) + _run(["n3", "n4"], 40.0)
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "network_fault" and rc.culprit.hosts == ["n1"], rc.summary


# -- timings per rank ----------------------------------------------------------------------------------------


def test_collective_times_that_differ_several_fold_are_a_straggler_the_shortest_arrived_last(tmp_path):
    text = """> Rank 0 has data tensor(8., device='cuda:0') time cost 31.5 bandwidth 12.7
> Rank 1 has data tensor(8., device='cuda:1') time cost 30.9 bandwidth 12.9
> Rank 2 has data tensor(8., device='cuda:2') time cost 29.8 bandwidth 13.4
> Rank 3 has data tensor(8., device='cuda:3') time cost 4.1 bandwidth 97.6
"""
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.ranks == [3], rc.summary
    assert "arrived last" in rc.summary


def test_close_shortest_collective_times_name_no_single_rank(tmp_path):
    text = """Rank 0 has data tensor(4., device='cuda:0') time cost 23.3 bandwidth 17.1
Rank 1 has data tensor(4., device='cuda:1') time cost 8.0 bandwidth 50.1
Rank 2 has data tensor(4., device='cuda:2') time cost 3.4 bandwidth 117.5
Rank 3 has data tensor(4., device='cuda:3') time cost 2.8 bandwidth 143.5
"""
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.ranks == [], rc.summary


def test_step_times_name_the_slow_rank(tmp_path):
    text = "".join(f"Rank {r} step time {t}s\n" for r, t in [(0, 1.1), (1, 1.0), (2, 4.9), (3, 1.2)])
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.ranks == [2], rc.summary


def test_a_table_where_a_few_ranks_load_data_for_the_whole_step_names_them(tmp_path):
    text = """[step 88] step_time=120.50s  dt_med=0.0031s  dt_max=101.20s
  Top 6 slowest ranks by data_time (step_time_med=120.50s):
     rank   data_time   step_time
       40     101.200      19.300
       41      98.100      22.400
       12       0.041     120.452
       77       0.030     120.470
        3       0.020     120.480
       90       0.011     120.490
"""
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.ranks == [40, 41], rc.summary
    assert "data_time" in rc.summary


def test_even_timings_are_no_finding(tmp_path):
    text = "Rank 0 time cost 10.1\nRank 1 time cost 10.4\nRank 2 time cost 9.8\n"
    assert not [f for f in _verdict(tmp_path, text).findings if f.category == "straggler"]


# -- pipeline schedules --------------------------------------------------------------------------------------


def test_two_ranks_that_both_send_before_receiving_deadlock(tmp_path):
    text = "rank 0:  [... 2F3, 0SendF1, 2RecvF0, 2F0]\nrank 1:  [... 3F2, 1SendF0, 1RecvF1, 1F1]\n"
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "p2p_deadlock" and rc.culprit.ranks == [0, 1], rc.summary
    assert "0SendF1" in rc.summary and "1SendF0" in rc.summary


def test_torch_spelling_and_receives_first_on_both_sides(tmp_path):
    text = "rank 0: [0F0, 0F1, 0RECV_B0, 0SEND_F1]\nrank 1: [1F0, 1RECV_F1, 1SEND_B0]\n"
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "p2p_deadlock" and rc.culprit.ranks == [0, 1], rc.summary
    assert "receive before they send" in rc.summary


def test_a_schedule_whose_pending_operations_meet_is_no_deadlock(tmp_path):
    text = "rank 0: [0F0, 0SEND_F0, 0RECV_B0, 0B0]\nrank 1: [1RECV_F0, 1F0, 1B0, 1SEND_B0]\n"
    assert not [f for f in _verdict(tmp_path, text).findings if f.category == "p2p_deadlock"]


# -- progress lines ------------------------------------------------------------------------------------------

_TIMEOUT = (
    "[rank{r}]:[E ProcessGroupNCCL.cpp:563] [Rank {r}] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800102 "
    "milliseconds before timing out.\n"
)


def test_a_rank_still_tokenizing_while_the_others_time_out_is_the_straggler(tmp_path):
    text = (
        "[rank1]:Running tokenizer on dataset:  12%|█▏        | 1200/10000 [08:01<58:48,  2.49 examples/s]\n"
        "[rank1]:Running tokenizer on dataset:  45%|████▌     | 4500/10000 [29:51<36:29,  2.51 examples/s]\n"
        + _TIMEOUT.format(r=0)
        + _TIMEOUT.format(r=2)
    )
    rc = _verdict(tmp_path, text).root_cause
    assert rc.category == "straggler" and rc.culprit.ranks == [1], rc.summary


def test_a_finished_bar_is_not_work_still_going_on(tmp_path):
    text = (
        "[rank1]:Running tokenizer on dataset: 100%|██████████| 10000/10000 [59:51<00:00,  2.51 examples/s]\n"
        + _TIMEOUT.format(r=0)
    )
    assert not [f for f in _verdict(tmp_path, text).findings if f.playbook == "busy_elsewhere"]


def test_odd_text_in_these_formats_never_raises(tmp_path):
    text = (
        "#  Rank  x Group  0 Pid  on  device\n# Avg bus bandwidth    : 1.2.3\n"
        "         8   2   float  sum  -1  N/A N/A N/A N/A N/A N/A N/A N/A\n"
        "rank 0: [0F0, 0SendF]\nrank 1: [..., 1RecvF]\n"
        "rank   time\n  x  1.0\n  1  nan\nRank 9 time cost 1e999\nnodeA1,nodeB2 0\n"
    )
    _verdict(tmp_path, text)


def test_a_bar_naming_no_rank_is_the_silent_ranks_when_the_others_time_out():
    """Ranks 1-3 time out; the tokenizer bar names no rank: rank 0, the one silent rank, is still at it."""
    from hangdx.playbooks import engine
    from hangdx.probes.bundle import evidence_from_paths

    wd = (
        "[E ProcessGroupNCCL.cpp:475] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, "
        "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800328 milliseconds before timing out."
    )
    bar = "Map (num_proc=8):  41%|████      | 410000/1000000 [29:55<43:08, 228.40 examples/s]"
    text = "\n".join([bar] + [wd.format(r=r) for r in (1, 2, 3)]) + "\n"
    v = engine.run(evidence_from_paths(["-"], stdin=text.encode()))
    assert v.root_cause.category == "straggler"
    assert v.root_cause.culprit.ranks == [0]
    text = "\n".join([bar] + [wd.format(r=r) for r in (2, 3)]) + "\n"  # ranks 0 and 1 silent: which one?
    assert engine.run(evidence_from_paths(["-"], stdin=text.encode())).root_cause.category != "straggler"


# nccl-tests' NCCLCHECK report (src/common.h); the binary prints its devices, creates its communicators, and only
# then the results' column header (util.cu, common.cu): a failure between the two is one of set-up.
_FAILED = "node-b: Test NCCL failure common.cu:959 'internal error - please report this issue to the NCCL developers / '\n .. node-b pid 3164639: Test failure common.cu:844\n"


def test_an_nccl_failure_before_the_results_header_is_a_set_up_failure_on_that_host(tmp_path):
    head = _run(["node-a", "node-b"], 40.0).split("#\n#      ")[0]  # the device list, no results header
    v = _verdict(tmp_path, head + _FAILED)
    assert v.root_cause.category == "comm_init_failure", v.root_cause.summary
    assert v.root_cause.culprit.hosts == ["node-b"]
    assert "internal error" in v.root_cause.summary


def test_an_nccl_failure_after_results_began_is_not_called_set_up(tmp_path):
    text = _run(["node-a", "node-b"], 40.0).split("# Out of bounds")[0] + _FAILED
    ev = _ev(tmp_path, text)
    [failure] = ev.events_of("nccl_error")
    assert failure.host == "node-b"
    assert engine.run(ev).root_cause.category != "comm_init_failure"
