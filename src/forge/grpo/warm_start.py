"""The warm start: the initial policy trained by SFT when its directory does not exist yet."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from forge.config import load_config
from forge.grpo.config import GRPOConfig
from forge.sft.config import SFTConfig


def ensure_warm_start(cfg: GRPOConfig, report: Callable[[str], None]) -> None:
    """Runs the configured SFT app when the initial policy directory does not exist yet,
    provided that its config exports to exactly that directory (a misspelled policy_path must
    not retrain and re-export over the warm start that is there). `report` tells the user."""
    if (Path(cfg.policy_path) / "config.json").exists() or cfg.warm_start.sft_config is None:
        return
    sft = load_config(SFTConfig, cfg.warm_start.sft_config, cfg.warm_start.sft_overrides)
    exported = sft.model_export_dir  # with LoRA, the merged model (export_merged)
    if exported is None or exported.resolve() != Path(cfg.policy_path).resolve():
        raise ValueError(
            f"policy_path: no model at {cfg.policy_path}, and the warm start ({cfg.warm_start.sft_config}) "
            f"exports a model to {exported}, not there: fix policy_path, or point warm_start at an SFT "
            "config that exports to it"
        )
    report(
        f"no initial policy at {cfg.policy_path}: training it with SFT ({cfg.warm_start.sft_config}) first"
    )
    command = [
        sys.executable,
        "-m",
        "apps.sft.main",
        "--config",
        cfg.warm_start.sft_config,
        *cfg.warm_start.sft_overrides,
    ]
    subprocess.run(command, check=True)
