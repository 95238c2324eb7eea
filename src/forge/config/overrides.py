"""Command-line overrides: `key.sub=value` sets a key, `~key.sub` deletes one."""

from collections.abc import Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from forge.config.errors import ConfigError
from forge.config.keys import parse_key

_SYNTAX_HINT = "expected KEY=VALUE (e.g. trainer.optimizer.lr=1e-5), or ~KEY to delete a key"


class _OverrideError(Exception):
    """One override is malformed; collected so that every bad override is reported together."""


def apply_overrides(config: DictConfig, overrides: Sequence[str]) -> dict[tuple[str, ...], str]:
    """Apply `overrides` to `config` in order; return each touched key path -> the override's text.

    A value replaces the existing one whole (a mapping value is not merged into the old
    mapping), so that every key under it can be attributed to this override in errors.
    """
    touched: dict[tuple[str, ...], str] = {}
    problems: list[str] = []
    for text in overrides:
        try:
            key = _apply_one(config, text)
        except _OverrideError as exc:
            problems.append(f"command-line override '{text}': {exc}")
            continue
        touched[parse_key(key)] = text
    if problems:
        raise ConfigError(problems)
    return touched


def _apply_one(config: DictConfig, text: str) -> str:
    if text.startswith("~"):
        key = text[1:]
        if not key or "=" in key:
            raise _OverrideError(
                "~KEY deletes a key and takes no value (e.g. ~trainer.optimizer.weight_decay)"
            )
        _delete(config, key)
        return key
    # `+key=value` (Hydra's "add a key") is accepted as a plain set.
    key, sep, raw_value = text.removeprefix("+").partition("=")
    if not sep or not parse_key(key):
        raise _OverrideError(_SYNTAX_HINT)
    try:
        OmegaConf.update(config, key, _parse_value(raw_value), merge=False)
    except OmegaConfBaseException as exc:
        raise _OverrideError(str(exc).splitlines()[0]) from None
    return key


def _parse_value(raw_value: str) -> object:
    # Parsed by OmegaConf's own loader (through a one-key dotlist), so that values read exactly
    # as in the YAML file: `1e-5` is a float, `[1, 2]` a list, and `${...}` stays an
    # interpolation to resolve once all overrides are in.
    try:
        parsed = OmegaConf.from_dotlist([f"value={raw_value}"])
    except yaml.YAMLError as exc:
        raise _OverrideError(f"value is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except OmegaConfBaseException as exc:
        raise _OverrideError(str(exc).splitlines()[0]) from None
    return OmegaConf.to_container(parsed, resolve=False)["value"]


def _delete(config: DictConfig, key: str) -> None:
    *parent_parts, leaf = parse_key(key)
    try:
        parent = OmegaConf.select(config, ".".join(parent_parts), default=None) if parent_parts else config
    except OmegaConfBaseException:
        parent = None  # the path runs through a broken interpolation or a `???` value
    # `keys()` rather than `in`: DictConfig's `in` is False for a key whose value is `???`.
    if isinstance(parent, DictConfig) and leaf in parent.keys():
        del parent[leaf]
    elif isinstance(parent, ListConfig) and leaf.isdigit() and int(leaf) < len(parent):
        del parent[int(leaf)]
    else:
        raise _OverrideError(f"there is no key '{key}' to delete")
