"""What activation checkpointing should do, as one immutable value.

The fields carry the JSON names of DeepSpeed's ``activation_checkpointing`` section, so a
config and a :class:`RecomputeSettings` read the same. Settings are validated once, when
built, so a bad value fails where it is written rather than at the first backward.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from pydantic import ValidationError

from zerospeed.config import ActivationCheckpointingConfig, Config
from zerospeed.config.load import read_source
from zerospeed.config.translate import config_error

SECTION = "activation_checkpointing"

#: What :meth:`RecomputeSettings.from_config` accepts.
SettingsSource = Union[Config, ActivationCheckpointingConfig, Mapping[str, Any], str,
                       "os.PathLike[str]"]


@dataclass(frozen=True)
class RecomputeSettings:
    """Options of activation checkpointing (DeepSpeed's ``activation_checkpointing`` keys).

    * ``partition_activations``: split saved activations across model-parallel ranks. zerospeed
      has no model parallelism yet, so only ``False`` is accepted.
    * ``contiguous_memory_optimization``: in DeepSpeed it copies the *partitioned* activations
      into one preallocated buffer against fragmentation; without partitioning there is nothing
      to pack, so it is accepted and has no effect.
    * ``cpu_checkpointing``: keep the tensors saved for the recompute (the checkpointed
      function's inputs) in host memory until backward needs them.
    * ``number_checkpoints``: how many checkpoints the model uses; informational, as in DeepSpeed
      (the model decides where to call ``checkpoint``).
    * ``synchronize_checkpoint_boundary``: synchronize the device before and after each
      checkpointed forward; synchronous devices (CPU) make this a no-op.
    * ``profile``: time every checkpointed forward and recompute (see ``Recomputer.timings``).
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "number_checkpoints":
                _check_count(value)
            elif not isinstance(value, bool):
                raise TypeError(f"{SECTION}.{field.name}: {value!r} is not a bool; pass True "
                                "or False")
        if self.partition_activations:
            raise NotImplementedError(
                f"{SECTION}.partition_activations=True needs model (tensor) parallelism to "
                "split activations across, which zerospeed does not have yet; set "
                "partition_activations to false")

    @classmethod
    def from_config(cls, source: SettingsSource) -> RecomputeSettings:
        """Settings from a DeepSpeed-style config: a dict, a JSON/hjson path, a base64 string,
        a parsed :class:`~zerospeed.config.Config` or just its ``activation_checkpointing`` section.

        Only the ``activation_checkpointing`` section is read and validated (with the config
        package's messages), so a config without batch sizes works here; the engine checks the
        rest of a config when it loads it.
        """
        if isinstance(source, Config):
            return cls.from_section(source.activation_checkpointing)
        if isinstance(source, ActivationCheckpointingConfig):
            return cls.from_section(source)
        raw = read_source(source)
        try:
            parsed = Config.model_validate({SECTION: raw.get(SECTION, {})})
        except ValidationError as err:
            raise config_error(err, Config) from None
        return cls.from_section(parsed.activation_checkpointing)

    @classmethod
    def from_section(cls, section: ActivationCheckpointingConfig) -> RecomputeSettings:
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})

    def overridden(self, **overrides: Any) -> RecomputeSettings:
        """A copy with every override that is not ``None`` applied (``configure``'s rule)."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown activation checkpointing setting(s) {unknown}; known: "
                            f"{[f.name for f in dataclasses.fields(self)]}")
        given = {name: value for name, value in overrides.items() if value is not None}
        return dataclasses.replace(self, **given)


def _check_count(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{SECTION}.number_checkpoints: {value!r} is out of range; pass an "
                         "integer >= 1 or None")
