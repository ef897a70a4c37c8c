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
        # The global rank a logger names wins over torchrun's `[defaultN]:`, which is the local rank.
        ("[default0]:[2023-10-01 10:00:00,123] [INFO] [logging.py:96:log_dist] [Rank 8] step=10", 8),
        # Not a rank: DeepSpeed's tag before the process group exists, a count with no log header before it, a
        # rank that its own world size rules out, a rank named in the message rather than in the header.
        (
            "[2023-10-01 10:00:00,123] [INFO] [logging.py:96:log_dist] [Rank -1] DeepSpeed info: version=0.14",
            None,
        ),
        ("INFO (3/8) Loading checkpoint shards", None),
        ("2023-04-13 16:00:05,621 INFO [trainer.py:650] (8/8) Reaches end of dataloader.", None),
        ("2023-04-13 16:00:05,621 INFO [train.py:88] waiting for [Rank 2] to finish", None),
        # With no log header a `[Rank N]` opens a message about that rank as often as one by it.
        ("[Rank 3] max allocated 12.1 GB", None),
        # icefall's tag only after its whole header (a time, a level, then `[file:line]`).
        ("[model.py:10] (1/4) Downloading shards", None),
    ],
)
def test_the_rank_in_a_log_header(text, rank):
    (line,) = Normaliser().line(1, text)
    assert line.rank == rank
    assert text.endswith(line.text)  # the header stays: its time and level are the line's


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
