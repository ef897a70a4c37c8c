#!/bin/sh
# Regenerates deploy/requirements.lock: every runtime dependency of pyproject.toml (no extras, so no torch)
# and deploy/lock-extra.in, pinned with a hash for every file, resolved for Python 3.11 on Linux x86_64.
# Run it on such a machine after changing pyproject's dependencies: sh deploy/lock.sh
# pip-tools lives in a throwaway venv under /tmp; the repository is copied so no build files land in it.
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3.11}
"$python" -c 'import platform, sys; assert sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64", \
    "run with CPython 3.11 on x86_64 (set PYTHON=...)"'
work=$(mktemp -d /tmp/hangdx-lock.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q pip-tools
mkdir "$work/src" "$work/src/deploy"
cp "$repo/deploy/lock-extra.in" "$work/src/deploy/"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/hangdx" "$repo/bot" "$repo/probes" "$repo/playbooks" \
    "$work/src/"
rm -rf "$work/src"/*.egg-info
# Resolve against PyPI alone: no local find-links, extra indexes or constraints from this machine's pip config.
(cd "$work/src" && env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    PIP_INDEX_URL=https://pypi.org/simple \
    "$work/venv/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras \
    --no-emit-index-url --no-emit-find-links --output-file=deploy/requirements.lock pyproject.toml deploy/lock-extra.in)
cp "$work/src/deploy/requirements.lock" "$repo/deploy/requirements.lock"
echo "wrote $repo/deploy/requirements.lock"
