"""Test-wide settings.

Hypothesis runs fixed examples by default (derandomised), so that the README's test command and CI run the same
tests the same way and a first run never fails on the luck of the draw. `HYPOTHESIS_PROFILE=explore` opts into
random exploration on a developer's machine; a defect it finds becomes a fixed test the day it is found, as
tests/core/test_fuzz.py does.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Two streams of tests at once (pytest-xdist, `-n 2 --dist loadgroup` in pyproject.toml): most live tests wait on
# real jobs, daemons and timeouts, so a 2-core machine runs two streams in about the time of the longer. Each
# folder runs whole, in order, in one stream; the folders that start the same kind of real parts are split so
# that each stream has its own kind (Slurm, the simulated cluster and sshd in one; the hang zoo and the CLI
# abuse in the other).
_STREAMS = {
    "abuse": "a", "zoo": "a", "core": "a", "deploy": "a",
    "bot": "b", "cluster": "b", "failure": "b", "slurm": "b", "ssh": "b", "probes": "b",
}  # fmt: skip


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    import pytest

    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.fspath), root).split(os.sep)
        item.add_marker(pytest.mark.xdist_group(_STREAMS.get(rel[0], "a")))
