"""forge.config: YAML file + dotlist overrides -> OmegaConf interpolation -> pydantic models.

cfg = parse_args(GRPOConfig, description="GRPO training")  # in an app's main
cfg = load_config(GRPOConfig, "configs/grpo/tiny_cpu.yaml", ["trainer.optimizer.lr=1e-5"])
save_config(cfg, run_dir / "config.yaml")
"""

from forge.config.base import ForgeConfigModel, compiled_regex
from forge.config.cli import parse_args
from forge.config.dump import config_to_dict, config_to_yaml, save_config
from forge.config.errors import ConfigError
from forge.config.loader import load_config

__all__ = [
    "ConfigError",
    "ForgeConfigModel",
    "compiled_regex",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "parse_args",
    "save_config",
]
