"""Reading a YAML config file, with errors that name the file and line."""

from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from forge.config.errors import ConfigError


def read_yaml_config(path: str | Path) -> tuple[DictConfig, dict[tuple[str, ...], int]]:
    """Load `path` into an (unresolved) DictConfig, plus the line of every key in it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path} (looked for {path.resolve()})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None

    try:
        # Composing gives the node tree with line marks; OmegaConf below builds the values.
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None and not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
            raise ConfigError(
                f"{path}:{root.start_mark.line + 1}: the top level of a config file must be a mapping "
                f"of sections (key: value), got {kind}"
            )
        # OmegaConf's own YAML loader, so that `1e-5` is a float as in overrides (plain YAML 1.1
        # reads it as a string), and duplicate keys are rejected.
        config = OmegaConf.create(text) if root is not None else OmegaConf.create({})
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_describe_yaml_error(path, exc)) from None
    except OmegaConfBaseException as exc:  # YAML that OmegaConf cannot hold, e.g. a list as a key
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None

    lines: dict[tuple[str, ...], int] = {}
    if root is not None:
        _collect_key_lines(root, (), lines)
    return config, lines


def _describe_yaml_error(path: Path, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    text = f"{where}: invalid YAML: {exc.problem or exc.context}"
    if exc.context and exc.problem and exc.context_mark:
        text += f" ({exc.context}, which starts at line {exc.context_mark.line + 1})"
    return text


def _collect_key_lines(node: yaml.Node, prefix: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> None:
    if isinstance(node, yaml.MappingNode):
        children = [(str(key.value), key, value) for key, value in node.value]
    elif isinstance(node, yaml.SequenceNode):
        children = [(str(index), item, item) for index, item in enumerate(node.value)]
    else:
        return
    for name, marked, value in children:
        path = (*prefix, name)
        lines[path] = marked.start_mark.line + 1
        _collect_key_lines(value, path, lines)
