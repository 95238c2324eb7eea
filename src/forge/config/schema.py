"""Reading a pydantic schema: which type a location expects, and how to say it in words."""

import types
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from forge.config.keys import KeyPath

_SCALAR_WORDS = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string",
    Path: "a path (string)",
    type(None): "null",
}


@dataclass
class Location:
    path: KeyPath  # the config key path (pydantic's location without its union-member tags)
    expected: Any  # the annotation expected there, None when the schema cannot tell
    owner: type[BaseModel] | None  # the model whose field is the last key, if any


def locate(schema: type[BaseModel], loc: tuple[str | int, ...]) -> Location:
    """Follow a pydantic error location through `schema`."""
    expected: Any = schema
    owner: type[BaseModel] | None = None
    path: list[str | int] = []
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        current = _strip_optional(expected)
        if _is_union(current):
            # pydantic tags an error inside a union with the member it tried; an error on the
            # union itself (tag is the last part) is described against the whole union.
            if parts:
                expected = _union_member(current, part)
            continue
        path.append(part)
        owner = current if _is_model(current) else None
        expected = _child_annotation(current, part)
    return Location(tuple(path), expected, owner)


def allowed_keys(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def describe_type(annotation: Any) -> str:
    """`float | None` -> "a number or null", `Literal["a", "b"]` -> "one of 'a', 'b'"."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return describe_type(get_args(annotation)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(value) for value in get_args(annotation))
    if _is_union(annotation):
        return " or ".join(describe_type(member) for member in get_args(annotation))
    if annotation in _SCALAR_WORDS:
        return _SCALAR_WORDS[annotation]
    if _is_model(annotation):
        return f"a mapping with keys {', '.join(allowed_keys(annotation))}"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(repr(member.value) for member in annotation)
    container = origin or annotation
    if isinstance(container, type) and issubclass(container, Mapping):
        return "a mapping"
    if isinstance(container, type) and issubclass(container, Sequence | Set):
        return "a list"
    return f"a value of type {getattr(annotation, '__name__', annotation)}"


def _child_annotation(annotation: Any, part: str | int) -> Any:
    if _is_model(annotation):
        for name, field in annotation.model_fields.items():
            if part in (name, field.alias):
                return field.annotation
        return None
    origin, args = get_origin(annotation), get_args(annotation)
    if not (isinstance(origin, type) and args):
        return None
    if issubclass(origin, Mapping):
        return args[1]
    if origin is tuple and args[-1] is not Ellipsis:
        return args[part] if isinstance(part, int) and part < len(args) else None
    if issubclass(origin, Sequence | Set):
        return args[0]
    return None


def _union_member(union: Any, tag: str | int) -> Any:
    """The member a union-tag location part names: a class name, or a discriminator value."""
    members = get_args(union)
    for member in members:
        if getattr(member, "__name__", None) == tag:
            return member
    for member in filter(_is_model, members):
        for field in member.model_fields.values():
            if get_origin(field.annotation) is Literal and tag in get_args(field.annotation):
                return member
    return None


def _strip_optional(annotation: Any) -> Any:
    """`X | None` -> X: pydantic reports errors inside an Optional without a union tag."""
    if get_origin(annotation) is Annotated:
        return _strip_optional(get_args(annotation)[0])
    if _is_union(annotation):
        members = [m for m in get_args(annotation) if m is not type(None)]
        if len(members) == 1:
            return _strip_optional(members[0])
        return Union[tuple(members)]  # noqa: UP007 (a union built at run time)
    return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
