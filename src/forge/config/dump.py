"""Writing a resolved config back out as YAML (for --print-config and next to run outputs)."""

from pathlib import Path

import yaml
from pydantic import BaseModel


def config_to_dict(config: BaseModel) -> dict:
    """Plain YAML-safe data: paths and enums become strings, tuples become lists."""
    return config.model_dump(mode="json")


def config_to_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, allow_unicode=True)


def save_config(config: BaseModel, path: str | Path) -> Path:
    """Write `config` as YAML to `path` (parent folders created); load_config reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(config), encoding="utf-8")
    return path
