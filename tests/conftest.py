"""Test-wide settings.

Hypothesis: random examples on a developer's machine (to find new defects), fixed ones in CI
(`HYPOTHESIS_PROFILE=ci`, set by .ci/run), so that a landing never depends on the luck of the draw. A defect
a local run finds gets its own deterministic test, as tests/core/test_fuzz.py does.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
