"""``load_config``: dict / JSON file / hjson file / base64 string -> checked :class:`Config`.

Mirrors how DeepSpeed reads its ``config`` argument (a dict, a path, or urlsafe base64
of the JSON) but refuses duplicate keys everywhere and says what it tried when a string
is neither a file nor base64.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any, Union

import hjson
from .errors import ConfigError
from .schema import Config

ConfigSource = Union[Config, Mapping[str, Any], str, "os.PathLike[str]"]


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_text(text: str, origin: str) -> dict[str, Any]:
    """Parse JSON (or, failing that, hjson) text; duplicate keys are an error."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as dup:
        raise ConfigError(f"{origin}: duplicate key {dup.key!r}; each key may appear only once "
                          "in an object") from None
    except json.JSONDecodeError as json_err:
        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except _DuplicateKey as dup:
            raise ConfigError(f"{origin}: duplicate key {dup.key!r}; each key may appear only "
                              "once in an object") from None
        except Exception as hjson_err:  # hjson raises its own HjsonDecodeError and others
            raise ConfigError(f"{origin}: not valid JSON ({json_err}) nor hjson ({hjson_err})"
                              ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: the top level is {type(data).__name__}, expected a JSON "
                          "object")
    return data


def read_file(path: pathlib.Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config file ({err})") from None
    return parse_text(text, str(path))


def _decode_base64(text: str) -> str | None:
    compact = "".join(text.split())
    compact += "=" * (-len(compact) % 4)
    for altchars in (b"-_", b"+/"):
        try:
            return base64.b64decode(compact, altchars=altchars, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            continue
    return None


def read_source(source: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The raw dict behind any accepted kind of source."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, os.PathLike):
        return read_file(pathlib.Path(source))
    if isinstance(source, str):
        if os.path.isfile(source):
            return read_file(pathlib.Path(source))
        decoded = _decode_base64(source) if source.strip() else None
        shown = source if len(source) <= 60 else source[:57] + "..."
        if decoded is None:
            raise ConfigError(f"{shown!r} is not an existing file, and not a urlsafe-base64 "
                              "encoded JSON config either (tried both)")
        try:
            return parse_text(decoded, "base64 config")
        except ConfigError as err:
            raise ConfigError(f"{shown!r} is not an existing file; decoded as base64 it is not "
                              f"a JSON config: {err}") from None
    raise ConfigError(f"config source of type {type(source).__name__} is not supported; pass "
                      "a dict, a path to a JSON/hjson file, or a base64-encoded JSON string")


def build_config(data: Mapping[str, Any], world_size: int) -> Config:
    """Validate ``data`` into a :class:`Config` and settle the batch arithmetic."""
    return Config.build(data, world_size)


def load_config(source: ConfigSource, *, world_size: int = 1) -> Config:
    """Parse and check a DeepSpeed-style config.

    ``source`` is a dict, an existing :class:`Config` (returned as is for the same world
    size, re-derived from the batch values as written otherwise), a path (``str`` or
    ``os.PathLike``) to a JSON or hjson file, or a urlsafe-base64 encoded JSON string.
    ``world_size`` is the data-parallel size the batch arithmetic is checked against.
    Every problem raises :class:`ConfigError`.
    """
    if isinstance(source, Config):
        if source.world_size == world_size:
            return source
        return build_config(source.source_dict(), world_size)
    return build_config(read_source(source), world_size)
