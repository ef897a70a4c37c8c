"""A traceback cut by a word wrap (a window or page that breaks lines at spaces) is read as the traceback it was.

Python prints a traceback as `Traceback (most recent call last):`, then per frame `  File "{file}", line {n}, in
{func}` and its indented source line, then `Type: message` (traceback.format_list / format_exception_only). A
narrow window leaves `File` or `Traceback (most` alone on a line, the rest on the next, and a launcher's prefix
(Ray's `(Actor pid=N, ip=A) `) on the first piece only; a paste that strips leading blanks leaves the source lines
unindented. The text below is in those formats, with made-up paths, pid and address.
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source

P = "(TrainWorker pid=4242, ip=10.0.0.7) "
WRAPPED = f"""\
{P}Traceback (most
recent call last):
{P}File
"/opt/app/train.py", line 88, in step
{P}self.save(state)
{P}File
"/opt/app/ckpt.py",
line 41, in save
{P}raise
RuntimeError(msg)
{P}RuntimeError:
checkpoint shard 3 is on cpu, expected cuda:0
"""


def _read(text: str) -> Evidence:
    ev = Evidence()
    reader.read_text([text.encode()], Source("paste.txt"), ev)
    return ev


def test_a_word_wrapped_traceback_is_one_exception_with_its_frames():
    (exc,) = _read(WRAPPED).events_of("exception")
    assert exc.fields["exc_type"] == "RuntimeError"
    assert exc.fields["message"] == "checkpoint shard 3 is on cpu, expected cuda:0"
    assert exc.fields["frames"] == ["/opt/app/train.py:88 in step", "/opt/app/ckpt.py:41 in save"]
    assert exc.pid == 4242 and exc.host == "10.0.0.7"


def test_the_process_that_raised_it_is_named_by_its_host():
    rc = engine.run(_read(WRAPPED)).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.hosts == ["10.0.0.7"]


def test_lines_of_another_process_are_not_joined_to_a_cut():
    text = f"{P}Traceback (most\n(TrainWorker pid=5151, ip=10.0.0.8) recent call last):\n"
    lines = reader.clean(list(enumerate(text.encode().splitlines(), 1)))
    assert [ln.text for ln in lines] == ["Traceback (most", "recent call last):"]


def test_a_line_that_only_names_a_file_is_not_joined_to_what_follows():
    text = "File\nsaved to /tmp/out.bin\nRuntimeError:\n=====================\n"
    lines = reader.clean(list(enumerate(text.encode().splitlines(), 1)))
    assert [ln.text for ln in lines] == [
        "File",
        "saved to /tmp/out.bin",
        "RuntimeError:",
        "=====================",
    ]


def test_a_log_message_after_a_cut_traceback_is_not_its_exception():
    # The traceback ends at a frame (the paste was cut); the lines after it are the program's own messages.
    text = (
        "Traceback (most recent call last):\n"
        '  File "/app/train.py", line 120, in <module>\n'
        "    trainer.fit(model)\n"
        '  File "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", line 1536, in barrier\n'
        "step 500 done, saving checkpoint\n"
        "wandb: Waiting for W&B process to finish... (failed 1).\n"
    )
    assert [e.fields["exc_type"] for e in _read(text).events_of("exception")] == []
