"""A row's `details`: the lines an emitter prints under its message that say whom it is about.

Ray's ActorDiedError (ray-project/ray python/ray/exceptions.py) prints, under `The actor died unexpectedly before
finishing this task.`, one line per known fact of the dead actor: `\\tclass_name: ...`, `\\tactor_id: ...`,
`\\tpid: {cause.pid}`, `\\tname: ...`, `\\tnamespace: ...`, `\\tip: {cause.node_ip_address}`, then its error message.
The text below is in that format, with a made-up id, pid and address.
"""

from __future__ import annotations

import pytest

from hangdx.playbooks import engine
from hangdx.probes import catalogue, reader
from hangdx.probes.model import Evidence, Source

ACTOR_DIED = """\
Traceback (most recent call last):
  File "/app/main_ppo.py", line 210, in main
    run_ppo(config)
ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
\tclass_name: create_colocated_worker_cls.<locals>.WorkerDict
\tactor_id: 6f3c1b4e2a0d9f8e7c6b5a4901000000
\tpid: 31337
\tname: ObQu7yWorkerDict_0:3
\tnamespace: 2f4f1a9e-5b8c-4d2e-9a7f-3c1e6b0d8a24
\tip: 10.0.4.17
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker \
unexpectedly exits with a connection error code 2. End of file.
"""


def _verdict(text: str):
    ev = Evidence()
    reader.read_text([text.encode()], Source("driver.log"), ev)
    return engine.run(ev)


def test_the_dead_actors_node_and_pid_are_the_culprit():
    rc = _verdict(ACTOR_DIED).root_cause
    assert rc.category == "rank_crashed"
    assert rc.culprit.hosts == ["10.0.4.17"]
    assert rc.culprit.processes == ["10.0.4.17 pid 31337"]
    assert "10.0.4.17 died" in rc.summary


def test_detail_lines_of_another_process_are_not_its():
    text = ACTOR_DIED.replace("\tip: 10.0.4.17", "(Worker pid=999, ip=10.0.9.9) ip: 10.0.9.9")
    rc = _verdict(text).root_cause
    assert "10.0.9.9" not in rc.culprit.hosts


def test_a_loopback_address_names_no_node_and_the_pid_still_names_the_process():
    rc = _verdict(ACTOR_DIED.replace("10.0.4.17", "127.0.0.1")).root_cause
    assert rc.category == "rank_crashed" and rc.culprit.hosts == []
    assert rc.culprit.processes == ["pid 31337"] and "(pid 31337) died" in rc.summary


def test_the_driver_that_printed_it_is_not_blamed():
    # The driver's own lines under Ray's prefix (verl's TaskRunner): it survived to print the error.
    driver = "(TaskRunner pid=777, ip=10.0.0.1) "
    text = "".join(driver + line + "\n" for line in ACTOR_DIED.splitlines())
    rc = _verdict(text).root_cause
    assert rc.culprit.hosts == ["10.0.4.17"] and rc.culprit.processes == ["10.0.4.17 pid 31337"]


ROW = """\
- id: x.details
  emitter: E
  source: a/b c.py
  pattern: 'the worker died unexpectedly'
  fields: []
  event: worker_died
  category: rank_crashed
  strength: suggestive
  meaning: m
  details: [{details}]
  examples: ['the worker died unexpectedly']
"""


@pytest.mark.parametrize("details", ["'pid: (\\d+)'", "'ip: (?P<a>\\S+) (?P<b>\\S+)'", "'pid: ('"])
def test_a_detail_pattern_gives_exactly_one_named_field(details):
    with pytest.raises(catalogue.CatalogueError, match="details"):
        catalogue.load_rows([("mine.yaml", ROW.format(details=details))])
