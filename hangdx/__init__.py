"""hangdx: diagnoses hung distributed training jobs."""

import os as _os

__version__ = "0.1.0"

# The layers live in top-level folders (bot/, probes/, playbooks/) and install as hangdx.bot, ...
# Run from a source checkout (tests, `python -m hangdx`), this folder shadows the installed
# package, so let it find its layers beside it, as the installed package has them inside.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "probes")):
    __path__.append(_root)  # noqa: F821 - a package's own __path__
