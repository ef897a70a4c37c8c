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
