"""Resolving `${...}` interpolations and `???` placeholders, reporting every failure at once."""

from omegaconf import Container, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from forge.config.keys import KeyPath, format_key


def resolve_config(config: DictConfig) -> tuple[dict, list[tuple[KeyPath, str]]]:
    """Return the fully resolved plain dict, or the problems as (key path, message naming the key).

    OmegaConf stops at the first failure; walking the tree first lets a user see every
    broken interpolation and unset `???` value in one go.
    """
    problems: list[tuple[KeyPath, str]] = []
    _check(config, (), problems)
    if problems:
        return {}, problems
    return OmegaConf.to_container(config, resolve=True, throw_on_missing=True), []


def _check(node: Container, path: KeyPath, problems: list[tuple[KeyPath, str]]) -> None:
    keys = list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))
    for key in keys:
        child_path = (*path, key)
        name = format_key(child_path)
        if OmegaConf.is_missing(node, key):
            problems.append(
                (child_path, f"{name}: no value ('???'): set it in the config file or pass {name}=VALUE")
            )
        elif OmegaConf.is_interpolation(node, key):
            # Not descended into: the target is checked where it is defined.
            try:
                node[key]
            except OmegaConfBaseException as exc:
                problems.append(
                    (child_path, f"{name}: cannot resolve '{_raw(node, key)}': {str(exc).splitlines()[0]}")
                )
        else:
            child = node[key]
            if isinstance(child, Container):
                _check(child, child_path, problems)


def _raw(node: Container, key: str | int) -> str:
    return OmegaConf.to_container(node, resolve=False)[key]
