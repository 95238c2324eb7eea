"""Shared pytest set-up. Tests are imported with importlib mode (see pyproject.toml)."""

import os

# Monarch reads these at import: keep child processes quiet and single-threaded so that
# several meshes fit on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
