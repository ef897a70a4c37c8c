"""What a verdict says reads as a person wrote it: no `?` standing in for a value nobody had, and no next step
asking for evidence that is already there (issue 13)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
INPUTS = sorted(p for p in FIXTURES.glob("*/*") if p.suffix in (".log", ".txt", ".json", ".pkl", ".out"))
PLACEHOLDER = re.compile(r"(^|[\s(])\?($|[\s).,;:])|\bNone\b")


def _texts(verdict) -> list[str]:
    out = []
    for f in verdict.findings:
        out += [f.summary, f.fix, *f.next_steps]
    return out


@pytest.mark.parametrize("path", INPUTS, ids=[f"{p.parent.name}/{p.name}" for p in INPUTS])
def test_no_verdict_prints_a_placeholder_for_a_missing_value(path):
    verdict = engine.run(evidence_from_paths([str(path)]))
    for text in _texts(verdict):
        assert not PLACEHOLDER.search(text), text


def test_next_steps_never_ask_for_the_flight_recorder_when_its_dumps_are_there():
    dumps = sorted(str(p) for p in (FIXTURES / "flight_recorder").glob("gloo_rank*.pkl"))
    verdict = engine.run(evidence_from_paths(dumps))
    assert verdict.root_cause is not None and verdict.root_cause.category == "conditional_collective"
    for f in verdict.findings:
        for step in f.next_steps:
            assert "TORCH_FR_BUFFER_SIZE" not in step and "Enable the Flight Recorder" not in step, step
