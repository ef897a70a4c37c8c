"""A logging library's own rank tag in its header names the rank that printed the line.

The formats are the emitters' own: DeepSpeed's log_dist (deepspeed/utils/logging.py: `"[Rank {}] {}"` under its
`[time] [LEVEL] [file:line:func] ` header), Lightning's rank_prefixed_message (lightning_fabric/utilities/
rank_zero.py: `f"[rank: {rank}] {message}"`) and icefall's setup_logger (icefall/utils.py: `%(asctime)s
%(levelname)s [%(filename)s:%(lineno)d] ({rank}/{world_size}) %(message)s`), which VALL-E and other recipes copy.
"""

from __future__ import annotations

import pytest

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source
from hangdx.probes.normalise import Normaliser


@pytest.mark.parametrize(
    ("text", "rank"),
    [
        (
            "[2023-10-01 10:00:00,123] [INFO] [logging.py:96:log_dist] [Rank 3] step=10, skipped=0, lr=[0.0001]",
            3,
        ),
        ("[rank: 1] Seed set to 42", 1),
        ("2023-04-13 16:00:05,621 INFO [trainer.py:650] (5/8) Reaches end of dataloader.", 5),
        # Not a rank: DeepSpeed's tag before the process group exists, a count with no log header before it, a
        # rank that its own world size rules out, a rank named in the message rather than in the header.
        (
            "[2023-10-01 10:00:00,123] [INFO] [logging.py:96:log_dist] [Rank -1] DeepSpeed info: version=0.14",
            None,
        ),
        ("INFO (3/8) Loading checkpoint shards", None),
        ("2023-04-13 16:00:05,621 INFO [trainer.py:650] (8/8) Reaches end of dataloader.", None),
        ("2023-04-13 16:00:05,621 INFO [train.py:88] waiting for [Rank 2] to finish", None),
    ],
)
def test_the_rank_in_a_log_header(text, rank):
    (line,) = Normaliser().line(1, text)
    assert line.rank == rank
    assert line.text == text  # the header stays: its time and level are the line's


# Four of eight ranks leave the training loop at the end of their data loader and start validation; the other four
# never log it (lifeiteng/vall-e's trainer, icefall's log format).
HALF_OUT_OF_DATA = "".join(
    f"2023-04-13 16:00:05,6{i}1 INFO [trainer.py:650] ({r}/8) Reaches end of dataloader.\n"
    f"2023-04-13 16:00:05,6{i}2 INFO [trainer.py:626] ({r}/8) Computing validation loss\n"
    for i, r in enumerate((5, 7, 4, 6))
)


def test_ranks_whose_data_ran_out_while_others_train_are_uneven_data():
    ev = Evidence()
    reader.read_text([HALF_OUT_OF_DATA.encode()], Source("train.log"), ev)
    v = engine.run(ev)
    assert v.root_cause.category == "conditional_collective"
    assert v.root_cause.culprit.ranks == [4, 5, 6, 7]


def _ranks(text: str) -> list[int | None]:
    return [ln.rank for ln in reader.clean(list(enumerate(text.encode().splitlines(), 1)))]


_WATCHDOG = (
    "[E ProcessGroupNCCL.cpp:475] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600094 milliseconds before timing out."
)


def test_torchruns_tee_prefix_is_the_local_rank_alone():
    # torchrun's `[{role}{local_rank}]:`: on a job of several nodes each node has its own `[default0]:`.
    text = "[default0]:Caught signal 11 (Segmentation fault)\n[default1]:Traceback (most recent call last):\n"
    assert _ranks(text) == [None, None]


def test_the_local_rank_is_the_rank_where_c10d_says_they_agree():
    text = "[default0]:Grouping texts in chunks\n[default2]:" + _WATCHDOG.format(r=2) + "\n"
    assert _ranks(text) == [0, 2]


def test_a_local_rank_that_c10d_contradicts_is_no_rank_and_the_message_names_it():
    text = "[default0]:" + _WATCHDOG.format(r=8) + "\n[default1]:" + _WATCHDOG.format(r=9) + "\n"
    assert _ranks(text) == [None, None]
    ev = Evidence()
    reader.read_text([text.encode()], Source("node1.log"), ev)
    assert sorted(e.rank for e in ev.events_of("watchdog_timeout")) == [8, 9]


def test_the_global_rank_torchrun_also_prints_is_the_rank():
    assert _ranks("[default0]:[rank12]:" + _WATCHDOG.format(r=12) + "\n") == [12]
