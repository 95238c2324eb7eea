#!/usr/bin/env bash
# Creates .venv and installs forge with its pinned stack, in the order that works:
#   1. torch first (the exact pin, so nothing later pulls a different build);
#   2. forge itself (editable) with the dev extra, constrained by requirements/lock.txt;
#   3. torchstore with --no-deps (its metadata pins versions that cannot run here).
# Idempotent: a stamp keyed on the pins skips everything when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.forge-install-stamp"
key=$(cat pyproject.toml requirements/lock.txt scripts/install.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$key" ]]; then
    echo "forge environment is up to date ($VENV)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 13), \
        f"forge needs Python 3.11 or 3.12, found {sys.version.split()[0]}: set PYTHON=python3.11"'
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip setuptools
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -c requirements/lock.txt --no-build-isolation -e ".[dev]"
"${pip[@]}" --no-deps "torchstore==0.1.2"
"$VENV/bin/python" -c "import forge.store, monarch.actor, torchtitan, transformers"
echo "$key" > "$STAMP"
echo "forge environment ready ($VENV)"
