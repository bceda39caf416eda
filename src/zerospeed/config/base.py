"""Base classes for config models: strict, frozen, alias-aware, and printable.

Every section of the config derives from :class:`Section`. A field that DeepSpeed knows
under several names declares them with :func:`names`; the first name is the one printed.
Giving two names of the same field is an error rather than a silent pick.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .values import FrozenDict, fail_many, freeze, thaw, unknown_key_message, zobject

# A passthrough key this close to a typed key of a loose section is taken for a typo of it.
_TYPO_CUTOFF = 0.8


def names(json_name: str, *other_names: str) -> dict[str, Any]:
    """Field kwargs accepting ``json_name`` (printed) and ``other_names`` (also accepted)."""
    return {"alias": json_name, "validation_alias": AliasChoices(json_name, *other_names)}


def aliased(json_name: str, *other_names: str, default: Any = PydanticUndefined,
            default_factory: Callable[[], Any] | None = None) -> Any:
    """A field known as ``json_name`` (printed) and ``other_names``, with its default.

    Typed ``Any`` on purpose: type checkers then read it as a plain default; they cannot follow
    ``Field(**names(...))`` (keyword unpacking into a field specifier).
    """
    if default_factory is not None:
        return Field(default_factory=default_factory, **names(json_name, *other_names))
    return Field(default, **names(json_name, *other_names))


def accepted_names(name: str, field: FieldInfo) -> tuple[str, ...]:
    """All keys under which a field may be given, printed name first."""
    found: list[str] = []
    if isinstance(field.validation_alias, AliasChoices):
        found += [c for c in field.validation_alias.choices if isinstance(c, str)]
    elif isinstance(field.validation_alias, str):
        found.append(field.validation_alias)
    if field.alias:
        found.append(field.alias)
    found.append(name)
    return tuple(dict.fromkeys(found))


def json_name(name: str, field: FieldInfo) -> str:
    return field.alias or name


def section_type(annotation: Any) -> type[Section] | None:
    """The Section class inside ``Optional[...]`` / ``Annotated[...]`` / unions, if any."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_type(arg)
        if found is not None:
            return found
    return None


class Section(BaseModel):
    """A strict, immutable config section.

    ``extra_keys`` lists keys a section accepts besides its fields (deprecated spellings
    consumed by a ``before`` validator); they count as valid for did-you-mean suggestions.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=False)

    extra_keys: ClassVar[tuple[str, ...]] = ()
    #: Fields known under several names, as (accepted names...) tuples; set per class.
    alias_groups: ClassVar[tuple[tuple[str, ...], ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        groups = (accepted_names(n, f) for n, f in cls.model_fields.items())
        cls.alias_groups = tuple(g for g in groups if len(g) > 1)

    @classmethod
    def key_names(cls) -> tuple[str, ...]:
        out: list[str] = []
        for name, field in cls.model_fields.items():
            out += accepted_names(name, field)
        return tuple(dict.fromkeys(out + list(cls.extra_keys)))

    @classmethod
    def field_for_key(cls, key: str) -> tuple[str, FieldInfo] | None:
        for name, field in cls.model_fields.items():
            if key in accepted_names(name, field):
                return name, field
        return None

    @model_validator(mode="before")
    @classmethod
    def _reject_duplicate_names(cls, data: Any) -> Any:
        """Two spellings of one setting (``bf16`` and ``bfloat16``...) must not both appear."""
        if not isinstance(data, Mapping):
            return data
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for group in cls.alias_groups:
            given = [k for k in group if k in data]
            if len(given) > 1:
                problems.append(((given[0],), f"also given as {given[1]}; they are the same "
                                              "setting, give only one"))
        if problems:
            fail_many(problems)
        return data

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict under DeepSpeed's key names; ``None`` values are left out."""
        out: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if value is None:
                continue
            out[json_name(name, field)] = dump_value(value)
        return out

    def iter_leaves(self, prefix: tuple[str | int, ...] = ()
                    ) -> Iterator[tuple[tuple[str | int, ...], Any]]:
        """Yield ``(key_path, value)`` for every leaf value, under printed key names."""
        for name, field in type(self).model_fields.items():
            yield from _leaves(prefix + (json_name(name, field),), getattr(self, name))


class LooseSection(Section):
    """A section for features zerospeed does not implement (yet).

    Known keys are typed strictly; any other key is kept verbatim (deep-frozen) in
    ``passthrough`` so that real DeepSpeed configs still parse and print unchanged.
    """

    passthrough: Annotated[FrozenDict, zobject()] = FrozenDict()

    @model_validator(mode="before")
    @classmethod
    def _collect_passthrough(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        known = set(cls.key_names()) - {"passthrough"}
        kept = {k: v for k, v in data.items() if k in known}
        rest = {k: v for k, v in data.items() if k not in known}
        typos: list[tuple[tuple[str | int, ...], str]] = [
            ((k,), unknown_key_message(k, sorted(known))) for k in rest
                 if difflib.get_close_matches(k, sorted(known), n=1, cutoff=_TYPO_CUTOFF)]
        if typos:  # "enable" for "enabled" would otherwise pass through and switch nothing on
            fail_many(typos)
        if rest:
            kept["passthrough"] = freeze(rest)
        return kept

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("passthrough", None)
        out.update(thaw(self.passthrough))
        return out

    def iter_leaves(self, prefix: tuple[str | int, ...] = ()
                    ) -> Iterator[tuple[tuple[str | int, ...], Any]]:
        kept = []
        for path, value in super().iter_leaves(prefix):
            if len(path) > len(prefix) and path[len(prefix)] == "passthrough":
                kept.append((prefix + path[len(prefix) + 1:], value))
            else:
                yield path, value
        yield from kept  # printed after the typed keys, as in to_dict


def dump_value(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, tuple) and any(isinstance(v, Section) for v in value):  # a list of sections
        return [dump_value(v) for v in value]
    return thaw(value)


def _leaves(path: tuple[str | int, ...], value: Any) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    if isinstance(value, Section):
        yield from value.iter_leaves(path)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(path + (str(k),), v)
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            yield from _leaves(path + (i,), v)
    else:
        yield path, value
