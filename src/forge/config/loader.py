"""load_config: YAML file + command-line overrides -> resolved -> validated pydantic model."""

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from omegaconf import OmegaConf
from pydantic import BaseModel, ValidationError

from forge.config.errors import ConfigError
from forge.config.messages import validation_problems
from forge.config.overrides import apply_overrides
from forge.config.resolve import resolve_config
from forge.config.sources import ConfigSources
from forge.config.yaml_file import read_yaml_config

Schema = TypeVar("Schema", bound=BaseModel)


def load_config(
    schema: type[Schema], config_path: str | Path | None, overrides: Sequence[str] = ()
) -> Schema:
    """Build a validated `schema` instance from a YAML file and `key=value` / `~key` overrides.

    Overrides apply in order after the file; `${...}` interpolations resolve after all
    overrides, so an interpolation sees the overridden values. Raises ConfigError listing
    every problem found, each naming the key, the file line or override it came from, and
    what is expected.
    """
    if config_path is None:
        config, lines = OmegaConf.create({}), {}
    else:
        config, lines = read_yaml_config(config_path)
    touched = apply_overrides(config, overrides)
    sources = ConfigSources(
        file=None if config_path is None else str(config_path), lines=lines, overrides=touched
    )

    data, problems = resolve_config(config)
    if problems:
        raise ConfigError([sources.with_source(path, text) for path, text in problems])
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        # The translated lines carry everything pydantic's report had, plus the source.
        raise ConfigError(validation_problems(schema, exc, sources)) from None
