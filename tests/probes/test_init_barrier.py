"""init_process_group's store barrier, as torch/distributed/distributed_c10d.py `_store_based_barrier` logs it.

Each rank that reaches init_process_group logs `Added key: store_based_barrier_key:N to store for rank: R`, then,
every 10 s while fewer than world_size processes have arrived, `Waiting in store based barrier to initialize process
group for rank: R, key: ... (world_size=W, worker_count=J, timeout=...)` (`num_workers_joined` since 2.1), and
`Rank R: Completed store-based barrier for key:... with W nodes.` once all have. The texts below are in that format
(the `logging` prefix of the INFO lines included), with made-up ranks and sizes.
"""

from __future__ import annotations

import pytest

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source

PREFIX = "INFO:torch.distributed.distributed_c10d:"
ADDED = PREFIX + "Added key: store_based_barrier_key:1 to store for rank: {r}\n"
WAITING = (
    PREFIX + "Waiting in store based barrier to initialize process group for rank: {r}, key: "
    "store_based_barrier_key:1 (world_size=4, {joined}=2, timeout=0:30:00)\n"
)
DONE = PREFIX + "Rank {r}: Completed store-based barrier for key:store_based_barrier_key:1 with 4 nodes.\n"


def _verdict(text: str):
    ev = Evidence()
    reader.read_text([text.encode()], Source("train.log"), ev)
    return engine.run(ev)


def test_a_barrier_that_waits_names_the_ranks_that_never_arrived():
    text = ADDED.format(r=0) + ADDED.format(r=2)
    text += WAITING.format(r=0, joined="worker_count") + WAITING.format(r=2, joined="worker_count")
    rc = _verdict(text).root_cause
    assert rc.category == "comm_init_failure"
    assert rc.culprit.ranks == [1, 3]
    assert "2 of 4" in rc.summary


def test_without_the_ranks_own_lines_no_rank_is_named():
    # The newer wording, and only the waiting side: who is missing is not in the text.
    rc = _verdict(WAITING.format(r=0, joined="num_workers_joined")).root_cause
    assert rc.category == "comm_init_failure"
    assert rc.culprit.ranks == []
    assert "does not say which" in rc.summary


def test_a_barrier_seen_completing_is_not_a_set_up_failure():
    text = ADDED.format(r=0) + WAITING.format(r=0, joined="worker_count")
    text += "".join(DONE.format(r=r) for r in range(4))
    assert _verdict(text).root_cause.category != "comm_init_failure"


# Lightning's set-up (lightning_fabric/utilities/distributed.py _init_dist_connection): every process logs
# `Initializing distributed: GLOBAL_RANK: r, MEMBER: r+1/W` before init_process_group; rank 0 logs `All distributed
# processes registered. Starting with W processes` after it.
LIGHTNING = "Initializing distributed: GLOBAL_RANK: {r}, MEMBER: {m}/4\n"
REGISTERED = "All distributed processes registered. Starting with 4 processes\n"


def _lightning(ranks) -> str:
    return "".join(LIGHTNING.format(r=r, m=r + 1) for r in ranks)


def test_lightning_set_up_that_never_registers_is_a_set_up_hang():
    rc = _verdict(_lightning(range(4))).root_cause
    assert rc.category == "comm_init_failure"
    assert rc.culprit.ranks == []  # nothing counts who arrived


def test_lightning_lines_of_some_ranks_name_no_missing_rank():
    # One node's log holds its own ranks only: the others are not named as never having started.
    rc = _verdict(_lightning([0, 1])).root_cause
    assert rc.category == "comm_init_failure"
    assert rc.culprit.ranks == []
    assert "not in the text" in rc.summary


@pytest.mark.parametrize(
    "after",
    [
        REGISTERED,
        "Epoch 0:  12%|#2        | 12/100 [00:10<01:10,  1.25it/s, loss=2.31]\n",
        "node1:100:100 [0] NCCL INFO comm 0x55d1 rank 0 nranks 4 cudaDev 0 busId 18000 - Init COMPLETE\n",
        "node1:100:100 [0] NCCL INFO AllReduce: opCount 5 sendbuff 0x7f1 recvbuff 0x7f1 count 1024 datatype 7 op 0 "
        "root 0 comm 0x55d1 [nranks=4] stream 0x55e1\n",
    ],
    ids=["registered", "progress", "nccl-init-complete", "nccl-collective"],
)
def test_lightning_set_up_followed_by_the_job_going_on_is_not_a_set_up_hang(after):
    assert _verdict(_lightning(range(4)) + after).root_cause.category != "comm_init_failure"


def test_the_newest_wording_is_read_too():
    line = (
        PREFIX + "Waiting in store based barrier to initialize process group for 30.01 secondsrank: 0, key: "
        "store_based_barrier_key:1 (world_size=4, num_workers_joined=3, timeout=0:30:00 error=Wait timeout)\n"
    )
    rc = _verdict(line).root_cause
    assert rc.category == "comm_init_failure"
    assert "3 of 4" in rc.summary


def test_the_count_said_is_the_highest_the_barrier_logged():
    text = ADDED.format(r=0) + ADDED.format(r=1) + ADDED.format(r=2)
    text += WAITING.format(r=1, joined="worker_count").replace("worker_count=2", "worker_count=1")
    text += WAITING.format(r=0, joined="worker_count").replace("worker_count=2", "worker_count=3")
    rc = _verdict(text).root_cause
    assert rc.culprit.ranks == [3]
    assert "3 of 4" in rc.summary


def test_the_waiting_processes_host_is_not_the_culprits():
    ev = Evidence()
    text = ADDED.format(r=0) + ADDED.format(r=1) + WAITING.format(r=0, joined="worker_count")
    reader.read_text([text.encode()], Source("node-a.log", host="node-a"), ev)
    rc = engine.run(ev).root_cause
    assert rc.culprit.ranks == [2, 3]
    assert "node-a" not in rc.culprit.hosts


def test_a_later_groups_barrier_names_no_rank():
    # new_group's barrier counts the group's members but logs global ranks: the missing ones cannot be told.
    text = (ADDED.format(r=0) + WAITING.format(r=0, joined="worker_count")).replace("key:1", "key:3")
    rc = _verdict(text).root_cause
    assert rc.category == "comm_init_failure"
    assert rc.culprit.ranks == []


def test_a_barrier_wait_the_job_is_seen_past_is_not_a_set_up_failure():
    text = WAITING.format(r=0, joined="worker_count")
    text += "Epoch 0:  12%|#2        | 12/100 [00:10<01:10,  1.25it/s, loss=2.31]\n"
    assert _verdict(text).root_cause.category != "comm_init_failure"


def test_lightning_lines_without_rank_zero_are_no_hang():
    # Only rank 0 prints the completion line: another node's log never has it.
    assert _verdict(_lightning(range(2, 4))).root_cause.category != "comm_init_failure"


def test_lightning_ranks_past_set_up_say_so():
    text = _lightning(range(4)) + "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0,1,2,3]\n"
    assert _verdict(text).root_cause.category != "comm_init_failure"
