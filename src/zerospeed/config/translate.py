"""Turn a pydantic ``ValidationError`` into :class:`ConfigError` lines.

No raw pydantic error ever reaches a user: each error becomes ``key.path: message``, where
the path uses the keys the user wrote and unknown keys get a did-you-mean computed from
the section the key was found in (field names, their aliases and deprecated spellings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from .base import Section, section_type
from .errors import ConfigError
from .values import ERROR_TYPE, MULTI_ERROR_TYPE, json_kind, show, unknown_key_message

Loc = tuple[str | int, ...]


def format_path(loc: Sequence[str | int]) -> str:
    """``("elasticity", "micro_batch_sizes", 1)`` -> ``"elasticity.micro_batch_sizes[1]"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def line(loc: Sequence[str | int], message: str) -> str:
    path = format_path(loc)
    return f"{path}: {message}" if path else message


def section_at(root: type[Section], loc: Sequence[str | int]) -> type[Section] | None:
    """The section class reached by following ``loc`` (user keys) from ``root``."""
    current: type[Section] | None = root
    for part in loc:
        if isinstance(part, int):  # an item of a list of sections (tensor_parallel...layer_specs[0])
            continue
        if current is None:
            return None
        found = current.field_for_key(part)
        if found is None:
            return None
        current = section_type(found[1].annotation)
    return current


def _lines_for(error: Any, root: type[Section]) -> list[str]:
    loc: Loc = tuple(error["loc"])
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == ERROR_TYPE:
        return [line(loc + tuple(ctx.get("sub", ())), str(ctx["msg"]))]
    if kind == MULTI_ERROR_TYPE:
        return [line(loc + tuple(sub), msg) for sub, msg in ctx["items"]]
    if kind == "extra_forbidden":
        section = section_at(root, loc[:-1])
        candidates = section.key_names() if section is not None else ()
        return [line(loc, unknown_key_message(str(loc[-1]), candidates))]
    if kind == "missing":
        return [line(loc, "required key is missing")]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        value = error.get("input")
        if value is None:
            return [line(loc, "null is not allowed; expected an object")]
        return [line(loc, f"{show(value)} is {json_kind(value)}; expected an object")]
    return [line(loc, f"{error.get('msg', 'invalid value')} (got {show(error.get('input'))})")]


def config_error(err: ValidationError, root: type[Section]) -> ConfigError:
    """All problems of ``err``, one line each, in the order pydantic found them."""
    lines: list[str] = []
    for error in err.errors(include_url=False):
        for text in _lines_for(error, root):
            if text not in lines:
                lines.append(text)
    return ConfigError(lines)
