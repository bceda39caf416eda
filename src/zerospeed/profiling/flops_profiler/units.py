"""Numbers as DeepSpeed's flops profiler prints them: ``1.23 G``, ``4.56 MMACs``, ``7.8 ms``, ``12.5 M``."""

from __future__ import annotations

DEFAULT_PRECISION = 2

_MAGNITUDES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))
_BY_UNIT = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "m": 1e-3, "u": 1e-6}


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` scaled to a metric prefix (chosen from its size unless ``units`` names one) and rounded."""
    if units is None:
        units, magnitude = "", 1.0
        for prefix, size in _MAGNITUDES:
            if num >= size:
                units, magnitude = prefix, size
                break
        else:
            if not (num >= 1 or num == 0):
                units, magnitude = ("m", 1e-3) if num >= 1e-3 else ("u", 1e-6)
    else:
        magnitude = _BY_UNIT.get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A rate: floating-point operations per second."""
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def bytes_to_string(b: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(b, units=units, precision=precision)}B"


def params_to_string(params_num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Parameter counts say ``B`` for billions, as DeepSpeed."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(duration, units=units, precision=precision)}s"


__all__ = ["DEFAULT_PRECISION", "number_to_string", "macs_to_string", "flops_to_string", "bytes_to_string",
           "params_to_string", "duration_to_string"]
