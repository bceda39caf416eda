"""``"auto"`` values: find them, fill them in one place, insist they are gone.

Key paths use DeepSpeed's printed names joined by dots (``optimizer.params.lr``,
``zero_optimization.stage3_prefetch_bucket_size``); accepted aliases such as
``zero_optimization.prefetch_bucket_size`` or ``bfloat16.enabled`` are understood too.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from .base import Section, json_name, section_type
from .errors import ConfigError
from .translate import format_path
from .values import AUTO, show, thaw

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def parse_path(path: str) -> list[str | int]:
    """``"a.b[1].c"`` -> ``["a", "b", 1, "c"]``."""
    return [int(idx) if idx else name for name, idx in _PART.findall(path)]


def canonical_path(root: type[Section], parts: list[str | int]) -> list[str | int]:
    """Replace accepted aliases by printed key names while the path runs through sections."""
    out: list[str | int] = []
    current: type[Section] | None = root
    for part in parts:
        if current is not None and isinstance(part, str):
            found = current.field_for_key(part)
            if found is not None:
                name, field = found
                out.append(json_name(name, field))
                current = section_type(field.annotation)
                continue
        out.append(part)
        current = None
    return out


def unresolved_auto(cfg: Section) -> list[str]:
    return [format_path(path) for path, value in cfg.iter_leaves() if value is AUTO]


def require_resolved(cfg: Section) -> None:
    remaining = unresolved_auto(cfg)
    if remaining:
        raise ConfigError([f'{path}: "auto" has not been resolved' for path in remaining])


def substitute_auto(data: dict[str, Any], root: type[Section],
                    values: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a config as written, sections of ``root``) with each ``"auto"`` named in ``values``
    replaced; the caller re-validates it into a new config. ``data`` itself is left as it is."""
    data = copy.deepcopy(data)
    problems: list[str] = []
    for path, value in values.items():
        parts = canonical_path(root, parse_path(path))
        container: Any = data
        for part in parts[:-1]:
            container = _child(container, part)
        key = parts[-1] if parts else None
        current = _child(container, key) if key is not None else _MISSING
        if current is _MISSING:
            problems.append(f"{path}: no such key in this config; only keys whose value is "
                            '"auto" can be resolved')
        elif current != "auto":
            problems.append(f'{path}: {show(current)} is not "auto"; only "auto" values can '
                            "be resolved")
        else:
            container[key] = thaw(value)
    if problems:
        raise ConfigError(problems)
    return data


_MISSING = object()


def _child(container: Any, key: str | int | None) -> Any:
    if isinstance(container, dict) and isinstance(key, str):
        return container.get(key, _MISSING)
    if isinstance(container, list) and isinstance(key, int) and 0 <= key < len(container):
        return container[key]
    return _MISSING
