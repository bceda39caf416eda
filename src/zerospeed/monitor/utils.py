"""Whether a monitor's package is installed, checked on every rank before any monitor starts (so a
missing package stops the whole job at ``initialize`` with the command that installs it)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

# section -> (import name, pip requirement, minimum version or None)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard", None),
    "wandb": ("wandb", "wandb", None),
    "comet": ("comet_ml", "comet_ml>=3.41.0", (3, 41, 0)),
}


class MonitorUnavailable(ImportError):
    """A monitor section is enabled but its package is missing (or too old)."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_availability(section: str) -> None:
    """Raise :class:`MonitorUnavailable` naming the package and its pip command unless ``section``'s
    monitor package can be imported (at the minimum version DeepSpeed asks for)."""
    module, requirement, minimum = PACKAGES[section]
    fix = f'pip install "{requirement}", or set {section}.enabled to false'
    if importlib.util.find_spec(module) is None:
        raise MonitorUnavailable(f"{section}.enabled is true but the {module} package is not installed: {fix}",
                                 name=module)
    if minimum is not None:
        version = importlib.metadata.version(module)
        if _version_tuple(version) < minimum:
            raise MonitorUnavailable(f"{section}.enabled is true but {module} {version} is installed, older than "
                                     f"{'.'.join(map(str, minimum))}: {fix}", name=module)


def check_tb_availability() -> None:
    check_availability("tensorboard")


def check_wandb_availability() -> None:
    check_availability("wandb")


def check_comet_availability() -> None:
    check_availability("comet")


__all__ = ["MonitorUnavailable", "check_availability", "check_comet_availability", "check_tb_availability",
           "check_wandb_availability"]
