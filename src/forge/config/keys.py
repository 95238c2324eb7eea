"""Key paths: the tuple form used internally and the dotted form users read and type."""

import re

KeyPath = tuple[str | int, ...]


def format_key(path: KeyPath) -> str:
    """`("trainer", "rewards", 0, "weight")` -> `trainer.rewards[0].weight` (OmegaConf's own notation)."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def parse_key(dotted: str) -> tuple[str, ...]:
    """`trainer.rewards[0].weight` or `trainer.rewards.0.weight` -> `("trainer", "rewards", "0", "weight")`."""
    return tuple(re.findall(r"[^.\[\]]+", dotted))


def normalize(path: KeyPath) -> tuple[str, ...]:
    """List indices as strings, so that paths from YAML, overrides and pydantic compare equal."""
    return tuple(str(part) for part in path)
