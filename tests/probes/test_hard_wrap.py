"""A terminal's hard wrap undone: a text cut at a fixed width is read as the messages it was cut from.

The wrapped example is ProcessGroupNCCL's heartbeat message as om-ai-lab/VLM-R1#257
(https://github.com/om-ai-lab/VLM-R1/issues/257) shows it, verbatim: cut at 116 columns, mid-word (`indi` /
`cates`), each message's last piece filled out with blanks. Texts whose longest lines are only as long as each other
(tables, record headers, one format repeated) are left as they are.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source
from hangdx.probes.normalise import hard_wrap_width, rejoin_hard_wraps

FIX = Path(__file__).resolve().parent.parent / "fixtures"

VLM_R1_257 = """\
[rank6]:[E429 13:55:49.384372190 ProcessGroupNCCL.cpp:1743] [PG ID 0 PG GUID 0(default_pg) Rank 6] ProcessGroupNCCL'
s watchdog got stuck for 480 seconds without making progress in monitoring enqueued collectives. This typically indi
cates a NCCL/CUDA API (e.g., CudaEventDestroy) hang blocking the watchdog, and could be triggered by another thread 
holding the GIL inside a CUDA api (for example, CudaEventDestroy), or other deadlock-prone behaviors.If you suspect 
the watchdog is not actually stuck and a longer timeout would help, you can either increase the timeout (TORCH_NCCL_
HEARTBEAT_TIMEOUT_SEC) to a larger value or disable the heartbeat monitor (TORCH_NCCL_ENABLE_MONITORING=0).If either
 of aforementioned helps, feel free to file an issue to PyTorch about the short timeout or false positive abort; oth
erwise, please attempt to debug the hang.                                                                           
[rank6]:[E429 13:55:49.384620373 ProcessGroupNCCL.cpp:1533] [PG ID 0 PG GUID 0(default_pg) Rank 6] ProcessGroupNCCL 
preparing to dump debug info. Include stack trace: 1                                                                
[rank6]:[F429 14:03:49.385461578 ProcessGroupNCCL.cpp:1554] [PG ID 0 PG GUID 0(default_pg) Rank 6] [PG ID 0 PG GUID 
0(default_pg) Rank 6] Terminating the process after attempting to dump debug info, due to ProcessGroupNCCL
"""  # noqa: W291 - the blanks are the terminal's


def _numbered(text: str) -> list[tuple[int, str]]:
    return list(enumerate(text.splitlines(), 1))


def test_a_hard_wrapped_message_is_one_line_again():
    lines = rejoin_hard_wraps(_numbered(VLM_R1_257))
    assert [no for no, _ in lines] == [1, 9, 11]
    first = lines[0][1]
    assert "ProcessGroupNCCL's watchdog got stuck for 480 seconds" in first
    assert "This typically indicates a NCCL/CUDA API" in first  # cut mid-word, joined with nothing between
    assert "(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)" in first and first.rstrip().endswith("debug the hang.")
    assert lines[2][1].endswith("due to ProcessGroupNCCL")


def test_the_rejoined_message_is_read_by_its_catalogue_row():
    ev = Evidence()
    reader.read_text([VLM_R1_257.encode()], Source("paste.txt"), ev)
    texts = [e.quote.text for e in ev.events]
    assert any("watchdog got stuck for 480 seconds" in t for t in texts)
    assert all(e.rank in (6, None) for e in ev.events)


def test_the_verdict_quotes_the_whole_message():
    ev = Evidence()
    reader.read_text([VLM_R1_257.encode()], Source("paste.txt"), ev)
    rc = engine.run(ev).root_cause
    # What the heartbeat monitor said, whole: cut in seven places, only its first piece would be quoted.
    assert "watchdog got stuck for 480 seconds" in rc.summary


@pytest.mark.parametrize(
    "name",
    [
        "gpu_live/h100_user_deadlock/bundle/vm/stacks-rank0-pid522.txt",  # a header before each sample
        "ip_link/ip_link_gpu_node.txt",  # each link's long second line, then the next link
        "perfquery/perfquery_x_two_samples_rising.txt",  # a header before each sample
        "real/conditional_collective__deepspeedai-DeepSpeed-2022.log",  # nvidia-smi's table, every line as long
        "real/p2p_deadlock__NVIDIA-nccl-584.log",  # NCCL's Send/Recv trace lines, all of one length
    ],
)
def test_lines_that_are_only_as_long_as_each_other_are_left(name):
    texts = (FIX / name).read_text().splitlines()
    assert hard_wrap_width(texts) is None
    numbered = _numbered((FIX / name).read_text())
    assert rejoin_hard_wraps(numbered) == numbered


def test_a_text_too_short_to_tell_is_left():
    two = _numbered("x" * 100 + "\n" + "y" * 20 + "\n")
    assert rejoin_hard_wraps(two) == two
