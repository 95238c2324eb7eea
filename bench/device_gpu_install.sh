#!/usr/bin/env bash
# On a GPU machine with no network (the `device` tool), forge's own GPU install: the CUDA build of
# torch 2.13.0 and vllm 0.32.0 by scripts/install.sh, from the wheels of bench/gpu_wheels.txt.
# Those are packed here into parts of at most 56 MiB, one carried per device call:
#
#   ../shared/device/pack --repack bench/gpu_wheels.txt .devgpu     (PACK_PLATFORMS: see below)
#   call k (k = 0 .. N-2):  bash .devgpu/partKK/unpack --check .devgpu        (carry .devgpu/partKK)
#   last call:  bash .devgpu/partLL/unpack --check .devgpu && bash bench/device_gpu_install.sh .
#
# Once every part is staged (in /tmp/devwh-stage) this rebuilds the folder of .whl files that
# scripts/install.sh takes as PIP_FIND_LINKS, makes a fresh venv and runs the project's install
# with no index. (`unpack` alone would install the wheels into the image's python instead.)
#
#   bash bench/device_gpu_install.sh [--wheels-only] [REPO_ROOT]     (REPO_ROOT default: .)
#
# Env: UNPACK_STAGE (default /tmp/devwh-stage), WHEELS (default /tmp/gpuwheels),
#      VENV (default /tmp/gpuvenv), PYTHON (default python3: the interpreter the venv is made from).
# The pack needs manylinux_2_18 (nvidia-nccl-cu13) and up to 2_31 (llguidance) among its platform
# tags: PACK_PLATFORMS="manylinux_2_28_x86_64 ... manylinux_2_5_x86_64 manylinux2014_x86_64
# manylinux_2_29_x86_64 ... manylinux_2_35_x86_64". pycosat, zss and cellpylib have no wheels on
# the registry: build them first (`pip wheel --no-deps pycosat==0.6.6 zss==1.2.0 cellpylib==2.4.0`)
# into a folder given to pack as PIP_FIND_LINKS.
set -euo pipefail
WONLY=0; [ "${1:-}" = --wheels-only ] && { WONLY=1; shift; }
REPO="$(cd "${1:-.}" && pwd)"
STAGE="${UNPACK_STAGE:-/tmp/devwh-stage}"; WH="${WHEELS:-/tmp/gpuwheels}"
VENV="${VENV:-/tmp/gpuvenv}"; PY="${PYTHON:-python3}"
say() { echo "gpuinstall: $*"; }
die() { echo "gpuinstall: ERROR: $*" >&2; exit 1; }
t0=$SECONDS
M="$(ls "$STAGE"/part[0-9][0-9]/MANIFEST 2>/dev/null | head -n1)"; [ -n "$M" ] || die "no staged part in $STAGE"
SHA=$(sed -n 's/^archive_sha256=//p' "$M"); MODE=$(sed -n 's/^mode=//p' "$M"); FMT=$(sed -n 's/^format=//p' "$M")
NW=$(sed -n 's/^wheels=//p' "$M")
if [ -f "$WH/.done-$SHA" ]; then
  say "wheel folder $WH already built for archive ${SHA:0:12}"
else
  FILES=(); MISS=()
  while read -r kind p f len psha; do
    [ "$kind" = part ] || continue
    if [ -f "$STAGE/$p/$f" ] && [ "$(sed -n 's/^archive_sha256=//p' "$STAGE/$p/MANIFEST")" = "$SHA" ]; then
      FILES+=("$STAGE/$p/$f")
    else MISS+=("$p"); fi
  done < "$M"
  [ ${#MISS[@]} -eq 0 ] || die "parts missing from $STAGE (carry them again): ${MISS[*]}"
  [ "$(cat "${FILES[@]}" | sha256sum | cut -d' ' -f1)" = "$SHA" ] || die "reassembled archive fails its sha256"
  say "archive ${SHA:0:12} verified (${#FILES[@]} parts) in $((SECONDS - t0)) s"
  WORK="$(mktemp -d /tmp/gpuinstall.XXXXXX)"; trap 'rm -rf "$WORK"' EXIT
  if [ "$FMT" = gzip ]; then DEC=(gzip -dc)
  elif command -v zstd >/dev/null; then DEC=(zstd -dc)
  else
    ZP=""
    if ! "$PY" -c 'import backports.zstd' 2>/dev/null && ! "$PY" -c 'import zstandard' 2>/dev/null; then
      read -r _ fp fw _ < <(grep '^fallback ' "$M") || die "no zstd decoder and no fallback wheel"
      "$PY" -m pip install -q --no-index --no-deps --target "$WORK/z" "$STAGE/$fp/$fw"; ZP="$WORK/z"
    fi
    DEC=(env PYTHONPATH="$ZP" "$PY" -c 'import sys, shutil
try:
    from backports import zstd; f = zstd.ZstdFile(sys.stdin.buffer)
except ImportError:
    import zstandard; f = zstandard.ZstdDecompressor().stream_reader(sys.stdin.buffer, read_across_frames=True)
shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)')
  fi
  rm -rf "$WH"; mkdir -p "$WH" "$WORK/t"
  if [ "$MODE" = repack ]; then
    cat "${FILES[@]}" | "${DEC[@]}" | tar -xf - -C "$WORK/t"
    "$PY" - "$WORK/t" "$WH" <<'PYEOF'
import os, shutil, sys, zipfile
stage, out = sys.argv[1], sys.argv[2]
for name in sorted(os.listdir(stage)):
    root = os.path.join(stage, name); files = []
    for d, dirs, fs in os.walk(root):
        dirs.sort(); files += [os.path.relpath(os.path.join(d, f), root) for f in fs]
    files.sort(key=lambda r: (".dist-info/" in r, r))
    with zipfile.ZipFile(os.path.join(out, name), "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for r in files:
            z.write(os.path.join(root, r), r)
    shutil.rmtree(root)  # keep the disk use at one copy
PYEOF
  else
    cat "${FILES[@]}" | "${DEC[@]}" | tar -xf - -C "$WH"
  fi
  n=$(ls "$WH"/*.whl | wc -l); [ "$n" = "$NW" ] || die "MANIFEST says $NW wheels, got $n"
  touch "$WH/.done-$SHA"
  say "$n wheels in $WH, $((SECONDS - t0)) s so far"
fi
[ "$WONLY" = 1 ] && exit 0
cd "$REPO"
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv "$VENV"; then  # a base python without ensurepip: bootstrap pip from its wheel
    say "venv with pip failed; making it --without-pip and installing pip from $WH"
    rm -rf "$VENV"; "$PY" -m venv --without-pip "$VENV"
    pw="$(ls "$WH"/pip-*.whl | head -n1)"
    "$VENV/bin/python" "$pw/pip" install -q --no-index "$pw"
  fi
fi
t1=$SECONDS
PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS="$WH" VENV="$VENV" bash scripts/install.sh
say "install.sh took $((SECONDS - t1)) s; total $((SECONDS - t0)) s"
