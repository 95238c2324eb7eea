"""Turning a pydantic ValidationError into one plain line per problem, with where and what to do."""

from difflib import get_close_matches
from enum import Enum
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError

from forge.config.keys import format_key
from forge.config.schema import Location, allowed_keys, describe_type, locate
from forge.config.sources import ConfigSources

# pydantic error types that mean "this value has the wrong type or is not an allowed choice".
_CHOICE_ERRORS = {"literal_error", "enum"}
_TYPE_ERRORS = {"int_from_float", "none_required", *_CHOICE_ERRORS}


def validation_problems(schema: type[BaseModel], exc: ValidationError, sources: ConfigSources) -> list[str]:
    problems: list[str] = []
    for error in exc.errors(include_url=False):
        location = locate(schema, error["loc"])
        line = sources.with_source(location.path, _describe(error, location))
        # Each member of a failed union reports the same problem; say it once.
        if line not in problems:
            problems.append(line)
    return problems


def _describe(error: dict[str, Any], location: Location) -> str:
    kind = error["type"]
    key = format_key(location.path)
    if kind == "extra_forbidden":
        return _unknown_key(location)
    if kind == "missing":
        return f"missing required key '{key}': add it to the config file or pass {key}=VALUE"
    value = error["input"]
    if (kind in _TYPE_ERRORS or kind.endswith(("_type", "_parsing"))) and location.expected is not None:
        text = f"{key}: expected {describe_type(location.expected)}, got {_show(value)}"
        if kind in _CHOICE_ERRORS:
            hint = _suggestion(value, _choices(location.expected))
            text += f".{hint}" if hint else ""
        return text
    # Constraint and custom-validator errors: pydantic's own sentence says what is wrong.
    text = f"{key or 'config'}: {error['msg']}"
    if not isinstance(value, dict | list):
        text += f", got {_show(value)}"
    return text


def _unknown_key(location: Location) -> str:
    *parent, name = location.path
    allowed = allowed_keys(location.owner) if location.owner else []
    text = f"unknown key '{format_key(location.path)}'.{_suggestion(name, allowed)}"
    if allowed:
        level = f"under '{format_key(tuple(parent))}'" if parent else "at the top level"
        text += f" Allowed keys {level}: {', '.join(allowed)}"
    return text


def _suggestion(value: Any, choices: list[str]) -> str:
    """A " Did you mean 'x'?" sentence naming the closest choice, or "" when none is close."""
    if not isinstance(value, str):
        return ""
    matches = get_close_matches(value, choices, n=1)
    return f" Did you mean '{matches[0]}'?" if matches else ""


def _choices(annotation: Any) -> list[str]:
    """The string values of the Literals (and Enums) in `annotation`, searched through unions."""
    if get_origin(annotation) is Literal:
        return [value for value in get_args(annotation) if isinstance(value, str)]
    if isinstance(annotation, type):
        return [str(member.value) for member in annotation] if issubclass(annotation, Enum) else []
    return [choice for member in get_args(annotation) for choice in _choices(member)]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"
