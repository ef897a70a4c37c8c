"""The real-world corpus: artifacts copied from public bug reports (tests/fixtures/real/, see its README).

Each case's sidecar names the category the thread confirmed and the culprit a careful reader of the artifact alone
could name; `hangdx analyze` on the artifact must find them. `python bench/accuracy.py --real` prints the table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
CASES = sorted(REAL.glob("*.yaml"))
CATEGORIES = {
    "conditional_collective", "collective_mismatch", "rank_crashed", "dataloader_stall", "io_stall",
    "user_deadlock", "p2p_deadlock", "ddp_unused_parameters", "gpu_fault", "network_fault",
    "comm_init_failure", "straggler", "unknown",
}  # fmt: skip


def _meta(side: Path) -> dict:
    return yaml.safe_load(side.read_text())


# Dev cases that hangdx still gets wrong, each with why (moved from the sealed set to fix a miss, and not fixed,
# because the evidence that names the cause is not in any emitter's format: a rule for it would fit that one
# case). Strict: a case that becomes right fails here until it is taken off this list. bench/accuracy.py --real
# counts them as wrong.
KNOWN_MISSES = {
    "conditional_collective__horovod-horovod-1407": "the culprit rank is named only by the program's own "
    "per-rank batch counts",
    "dataloader_stall__meta-pytorch-data-659": "a traceback behind pytest's `E` prefix, cut before its exception",
    "p2p_deadlock__hpcaitech-ColossalAI-3383": "a hand-written debug print log, not any library's format",
    "rank_crashed__modelscope-FunASR-2006": "the host is named only through NCCL's local ranks; mapping one to a "
    "global rank would be a guess",
}


@pytest.mark.parametrize(
    "side",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[c.stem]))
        if c.stem in KNOWN_MISSES
        else c
        for c in CASES
    ],
    ids=[c.stem for c in CASES],
)
def test_a_real_case_gets_the_category_and_culprit_its_thread_confirmed(side):
    meta = _meta(side)
    v = engine.run(evidence_from_paths([str(side.with_suffix(".log"))]))
    rc = v.root_cause
    assert rc is not None
    assert rc.category == meta["category"], f"{meta['url']}: {rc.summary}"
    culprit = meta.get("culprit") or {}
    if culprit.get("ranks"):
        assert sorted(set(rc.culprit.ranks)) == sorted(set(culprit["ranks"])), rc.summary
    if culprit.get("hosts"):
        assert set(culprit["hosts"]) <= set(rc.culprit.hosts), rc.summary


def test_every_known_miss_is_a_case():
    assert set(KNOWN_MISSES) <= {c.stem for c in CASES}


def test_every_case_has_its_artifact_a_source_and_a_confirmed_cause():
    assert CASES
    logs = {p.stem for p in REAL.glob("*.log")}
    assert logs == {c.stem for c in CASES}, logs ^ {c.stem for c in CASES}  # no artifact without its sidecar
    for side in CASES:
        meta = _meta(side)
        assert str(meta["url"]).startswith("https://"), side
        assert meta["category"] in CATEGORIES, side
        assert meta.get("confirmed_cause") and meta.get("confirmed_by"), side
        assert isinstance(meta.get("belief_only"), bool), side


def test_the_command_line_reads_a_real_paste_from_standard_input():
    side = next(s for s in CASES if _meta(s)["category"] != "unknown")
    r = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", "-", "--json"],
        input=side.with_suffix(".log").read_bytes(),
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["root_cause"]["category"] == _meta(side)["category"]
