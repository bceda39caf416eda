"""Value types and strict scalar validators shared by every config model.

Each validator turns one JSON value into one typed Python value or raises a pydantic
custom error whose message is already the final user-facing text ("4 is not allowed;
expected one of 0, 1, 2, 3"); ``translate.py`` only prefixes the key path. Writing the
checks by hand (instead of relying on pydantic's coercion) is what makes ``"true"`` for a
bool and ``true`` for an int errors, while ``5e8`` for an int and ``1`` for a float pass.
"""

from __future__ import annotations

import difflib
import enum
import json
import math
import pathlib
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NoReturn, TypeVar

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

T = TypeVar("T")

#: Error type used for every message produced here; ``ctx["sub"]`` is an optional key path
#: below the reporting location, ``ctx["items"]`` (type ``MULTI``) carries several problems.
ERROR_TYPE = "zerospeed"
MULTI_ERROR_TYPE = "zerospeed_multi"


class Auto(enum.Enum):
    """The explicit ``"auto"`` value: left for a caller (e.g. an HF Trainer) to decide."""

    AUTO = "auto"

    def __repr__(self) -> str:
        return "AUTO"

    def __str__(self) -> str:
        return "auto"


AUTO = Auto.AUTO


class OffloadDevice(str, enum.Enum):
    """Where ZeRO keeps offloaded state."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"

    def __str__(self) -> str:
        return self.value


class DType(str, enum.Enum):
    """A floating point dtype named the way DeepSpeed configs name it."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value

    @property
    def torch_dtype(self) -> Any:
        """The matching ``torch.dtype`` (torch imported lazily: config parsing stays light)."""
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.value]


#: Every spelling DeepSpeed accepts for a dtype (compared lower-cased).
DTYPE_SPELLINGS: Mapping[str, DType] = MappingProxyType({
    "fp32": DType.FP32, "float32": DType.FP32, "float": DType.FP32, "torch.float32": DType.FP32,
    "fp16": DType.FP16, "float16": DType.FP16, "half": DType.FP16, "torch.float16": DType.FP16,
    "bf16": DType.BF16, "bfloat16": DType.BF16, "torch.bfloat16": DType.BF16,
})


class FrozenDict(Mapping[str, Any]):
    """An immutable, hashable mapping used for free-form parts of the config.

    Values are deep-frozen by :func:`freeze` (dict -> FrozenDict, list -> tuple,
    ``"auto"`` -> :data:`AUTO`), so a frozen config cannot be mutated through them.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"


def freeze(value: Any) -> Any:
    """Deep-freeze a JSON value; ``"auto"`` strings become :data:`AUTO`."""
    if isinstance(value, Mapping):
        return FrozenDict({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if value == "auto" and isinstance(value, str):
        return AUTO
    return value


def thaw(value: Any) -> Any:
    """Inverse of :func:`freeze` for output: plain JSON-compatible Python values."""
    if isinstance(value, Auto):
        return "auto"
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return value


# ----------------------------------------------------------------------------- messages


def show(value: Any) -> str:
    """Render a user value the way it looks in JSON (``true``, ``"cpu"``, ``null``)."""
    if isinstance(value, Auto):
        return '"auto"'
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(thaw(value))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def json_kind(value: Any) -> str:
    """The JSON type of a value, with its article, for "is a string"-style messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    if value is None:
        return "null"
    if isinstance(value, Auto):
        return "not allowed here"  # reads: '"auto" is not allowed here; expected ...'
    return f"a {type(value).__name__}"


def fail(message: str, sub: tuple[str | int, ...] = ()) -> NoReturn:
    """Raise a pydantic error carrying ``message`` verbatim (``sub`` extends the key path)."""
    raise PydanticCustomError(ERROR_TYPE, "{msg}", {"msg": message, "sub": sub})


def fail_many(items: list[tuple[tuple[str | int, ...], str]]) -> NoReturn:
    """Raise several problems at once; each item is ``(sub_path, message)``."""
    raise PydanticCustomError(
        MULTI_ERROR_TYPE, "{msg}", {"msg": "; ".join(m for _, m in items), "items": tuple(items)}
    )


def _num(x: float | int) -> str:
    return str(x)


def range_phrase(kind: str, ge: float | None = None, gt: float | None = None,
                 le: float | None = None, lt: float | None = None) -> str:
    """``"an integer >= 1"``, ``"a number between 0 and 1"``... for messages."""
    low = (">=", ge) if ge is not None else ((">", gt) if gt is not None else None)
    high = ("<=", le) if le is not None else (("<", lt) if lt is not None else None)
    if low and high and low[0] == ">=" and high[0] == "<=":
        return f"{kind} between {_num(low[1])} and {_num(high[1])}"
    parts = [f"{bound[0]} {_num(bound[1])}" for bound in (low, high) if bound is not None]
    return f"{kind} {' and '.join(parts)}" if parts else kind


# ----------------------------------------------------------------------------- checks


def check_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    fail(f"{show(value)} is {json_kind(value)}; expected true or false")


def check_int(value: Any, *, ge: int | None = None, le: int | None = None,
              choices: tuple[int, ...] | None = None) -> int:
    def expected() -> str:
        return (f"one of {', '.join(map(str, choices))}" if choices
                else range_phrase("an integer", ge=ge, le=le))

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"{show(value)} is {json_kind(value)}; expected {expected()}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            fail(f"{show(value)} is not a whole number; expected {expected()}")
        value = int(value)
    if choices is not None and value not in choices:
        fail(f"{value} is not allowed; expected {expected()}")
    if (ge is not None and value < ge) or (le is not None and value > le):
        fail(f"{value} is out of range; expected {expected()}")
    return value


def check_float(value: Any, *, ge: float | None = None, gt: float | None = None,
                le: float | None = None, lt: float | None = None) -> float:
    def expected() -> str:
        return range_phrase("a number", ge=ge, gt=gt, le=le, lt=lt)

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"{show(value)} is {json_kind(value)}; expected {expected()}")
    number = float(value)
    if not math.isfinite(number):
        fail(f"{show(value)} is not a finite number; expected {expected()}")
    if ((ge is not None and number < ge) or (gt is not None and number <= gt)
            or (le is not None and number > le) or (lt is not None and number >= lt)):
        fail(f"{show(value)} is out of range; expected {expected()}")
    return number


def check_str(value: Any) -> str:
    if not isinstance(value, str):
        fail(f"{show(value)} is {json_kind(value)}; expected a string")
    return value


def check_choice(value: Any, options: Mapping[str, T], shown: tuple[str, ...],
                 case: str | None = None) -> T:
    """Map an accepted spelling (optionally case-folded) to its canonical value."""
    expected = "one of " + ", ".join(json.dumps(s) for s in shown)
    if not isinstance(value, str):
        fail(f"{show(value)} is {json_kind(value)}; expected {expected}")
    key = value.lower() if case == "lower" else value.upper() if case == "upper" else value
    if key not in options:
        fail(f"{show(value)} is not allowed; expected {expected}")
    return options[key]


def check_str_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        fail(f"{show(value)} is {json_kind(value)}; expected an array of strings")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            fail(f"{show(item)} is {json_kind(item)}; expected a string", (i,))
    return tuple(value)


def check_int_list(value: Any, ge: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        fail(f"{show(value)} is {json_kind(value)}; expected an array of integers")
    out = []
    for i, item in enumerate(value):
        try:
            out.append(check_int(item, ge=ge))
        except PydanticCustomError as err:
            fail(str(err.context["msg"]) if err.context else str(err), (i,))
    return tuple(out)


def check_object(value: Any) -> FrozenDict:
    if not isinstance(value, Mapping):
        fail(f"{show(value)} is {json_kind(value)}; expected an object")
    return freeze(value)


def check_path(value: Any) -> pathlib.Path:
    if isinstance(value, pathlib.PurePath):
        return pathlib.Path(value)
    return pathlib.Path(check_str(value))


# ----------------------------------------------------------------------------- annotations


def validator(check: Callable[[Any], Any], expected: str, *, auto: bool = False,
              nullable: bool = False) -> PlainValidator:
    """Wrap a check into a pydantic validator that also handles ``"auto"`` and ``null``."""

    def validate(value: Any) -> Any:
        if value is None:
            if nullable:
                return None
            fail(f"null is not allowed; expected {expected}")
        if isinstance(value, Auto) or (isinstance(value, str) and value == "auto"):
            if auto:
                return AUTO
            fail(f'"auto" is not accepted for this key; expected {expected}')
        return check(value)

    return PlainValidator(validate)


def zbool(*, auto: bool = False, nullable: bool = False) -> PlainValidator:
    return validator(check_bool, "true or false", auto=auto, nullable=nullable)


def zint(*, ge: int | None = None, le: int | None = None, choices: tuple[int, ...] | None = None,
         auto: bool = False, nullable: bool = False) -> PlainValidator:
    expected = (f"one of {', '.join(map(str, choices))}" if choices
                else range_phrase("an integer", ge=ge, le=le))
    return validator(lambda v: check_int(v, ge=ge, le=le, choices=choices), expected,
                     auto=auto, nullable=nullable)


def zfloat(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, auto: bool = False, nullable: bool = False) -> PlainValidator:
    expected = range_phrase("a number", ge=ge, gt=gt, le=le, lt=lt)
    return validator(lambda v: check_float(v, ge=ge, gt=gt, le=le, lt=lt), expected,
                     auto=auto, nullable=nullable)


def zstr(*, auto: bool = False, nullable: bool = False) -> PlainValidator:
    return validator(check_str, "a string", auto=auto, nullable=nullable)


def zchoice(options: Mapping[str, Any], shown: tuple[str, ...] | None = None, *,
            case: str | None = None, auto: bool = False, nullable: bool = False) -> PlainValidator:
    shown = shown if shown is not None else tuple(options)
    expected = "one of " + ", ".join(json.dumps(s) for s in shown)
    return validator(lambda v: check_choice(v, options, shown, case), expected,
                     auto=auto, nullable=nullable)


def zenum(enum_cls: type[enum.Enum], *, auto: bool = False,
          nullable: bool = False) -> PlainValidator:
    options = {m.value: m for m in enum_cls}
    return zchoice(options, tuple(options), auto=auto, nullable=nullable)


def zdtype(*, auto: bool = False, nullable: bool = False) -> PlainValidator:
    return zchoice(DTYPE_SPELLINGS, ("fp32", "fp16", "bf16"), case="lower", auto=auto,
                   nullable=nullable)


def zstrlist(*, nullable: bool = False) -> PlainValidator:
    return validator(check_str_list, "an array of strings", nullable=nullable)


def zintlist(*, ge: int | None = None, nullable: bool = False) -> PlainValidator:
    return validator(lambda v: check_int_list(v, ge=ge), "an array of integers", nullable=nullable)


def zobject(*, nullable: bool = False) -> PlainValidator:
    return validator(check_object, "an object", nullable=nullable)


def zpath(*, nullable: bool = False) -> PlainValidator:
    return validator(check_path, "a path string", nullable=nullable)


def unknown_key_message(key: str, candidates: list[str] | tuple[str, ...]) -> str:
    """``unknown key; did you mean X?`` (or the list of valid keys when nothing is close)."""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        if key.lower() in lowered:
            close = [lowered[key.lower()]]
    if close:
        return f"unknown key; did you mean {close[0]}?"
    if not candidates:
        return "unknown key; this section takes no keys"
    return "unknown key; valid keys are " + ", ".join(sorted(candidates))
