"""The root :class:`Config`: a DeepSpeed 0.19 config, typed, checked for one world size.

Build one with :func:`zerospeed.config.load_config`, not directly: loading also checks
the batch arithmetic against the world size and turns every problem into a
:class:`~zerospeed.config.errors.ConfigError`. A built config is never changed:
:meth:`Config.resolve_auto` returns a new one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import PrivateAttr, ValidationError

from .auto import require_resolved, substitute_auto, unresolved_auto
from .batch import resolve_batch
from .errors import ConfigError
from .features import check_implemented, features_in_use
from .schema_precision import BF16Config
from .schema_root import ConfigSections
from .translate import config_error
from .values import AUTO, Auto, DType


class Config(ConfigSections):
    """A parsed, frozen DeepSpeed-style configuration.

    Attribute names are DeepSpeed's JSON keys (``cfg.zero_optimization.stage``,
    ``cfg.fp16.loss_scale_window``...). ``"auto"`` values stay :data:`AUTO` until
    :meth:`resolve_auto` replaces them (in a new config).
    """

    _world_size: int = PrivateAttr(default=1)
    #: The batch values as written (before derivation), to re-derive for another world size.
    _batch_given: tuple[int | Auto | None, ...] = PrivateAttr(default=(None, None, None))

    def __eq__(self, other: object) -> bool:
        """Equal settings and world size (how the batch values were written does not count)."""
        if not isinstance(other, Config):
            return NotImplemented
        return self.__dict__ == other.__dict__ and self._world_size == other._world_size

    def __hash__(self) -> int:
        return hash((tuple(self.__dict__.values()), self._world_size))


    @classmethod
    def build(cls, data: Mapping[str, Any], world_size: int) -> Config:
        """Validate ``data`` and settle the batch arithmetic for ``world_size`` (the one constructor
        :func:`~zerospeed.config.load_config` uses); the private fields are set here, before
        anyone holds the config."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size: {world_size!r} is out of range; expected an integer >= 1")
        try:
            cfg = cls.model_validate(data)
        except ValidationError as err:
            raise config_error(err, cls) from None
        given = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                 cfg.gradient_accumulation_steps)
        train, micro, gas = given
        if cfg.elasticity.enabled:
            # DeepSpeed's elastic branch: the section, as written, decides all three at this world size
            from zerospeed.elasticity.runtime import elastic_batch

            elastic = elastic_batch(data, world_size)
            cfg = cfg.model_copy(update={
                "train_batch_size": elastic.train_batch_size,
                "train_micro_batch_size_per_gpu": elastic.train_micro_batch_size_per_gpu,
                "gradient_accumulation_steps": elastic.gradient_accumulation_steps,
            })
        elif (not isinstance(train, Auto)
                and not isinstance(micro, Auto) and not isinstance(gas, Auto)):
            sizes = resolve_batch(train, micro, gas, world_size=world_size)
            cfg = cfg.model_copy(update={
                "train_batch_size": sizes.train_batch_size,
                "train_micro_batch_size_per_gpu": sizes.train_micro_batch_size_per_gpu,
                "gradient_accumulation_steps": sizes.gradient_accumulation_steps,
            })
        cfg._world_size = world_size
        cfg._batch_given = given
        return cfg

    # -- convenience ----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch arithmetic was checked against."""
        return self._world_size

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization.enabled

    @property
    def zero_stage(self) -> int | Auto:
        return self.zero_optimization.stage

    @property
    def precision(self) -> DType:
        """The compute precision: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (a ``str`` enum)."""
        for name in ("fp16", "bf16"):
            if isinstance(getattr(self, name).enabled, Auto):
                raise ConfigError(f'{name}.enabled: "auto" is not resolved yet; the precision '
                                  "is undecided (call resolve_auto first)")
        if self.fp16.enabled:
            return DType.FP16
        if self.bf16.enabled:
            return DType.BF16
        return DType.FP32

    @property
    def bfloat16(self) -> BF16Config:
        """Older name of :attr:`bf16`."""
        return self.bf16

    def source_dict(self) -> dict[str, Any]:
        """Like :meth:`to_dict`, but with the batch keys as originally written (derived ones
        left out), so the config can be re-checked for another world size."""
        data = self.to_dict()
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps")
        for key, given in zip(keys, self._batch_given):
            data.pop(key, None)
            if given is not None:
                data[key] = "auto" if isinstance(given, Auto) else given
        return data

    def get(self, key: str, default: Any = None) -> Any:
        """``to_dict().get(key, default)``: DeepSpeed's ``engine.config`` is the config dict, and
        frameworks read it so (the HF Trainer: ``engine.config.get("zero_optimization", {})``)."""
        return self.to_dict().get(key, default)

    def to_json(self, indent: int | None = 2) -> str:
        """The resolved config as DeepSpeed JSON: every default filled in, DeepSpeed names."""
        return json.dumps(self.to_dict(), indent=indent)

    def features_in_use(self) -> tuple[str, ...]:
        """Key paths of every non-default feature this config asks for (see ``features``)."""
        return features_in_use(self)

    def check_implemented(self, implemented: frozenset[str] | set[str]) -> None:
        """Raise ``NotImplementedError`` naming each requested feature not in ``implemented``."""
        check_implemented(self, implemented)

    def unresolved_auto(self) -> list[str]:
        """Key paths whose value is still ``"auto"``."""
        return unresolved_auto(self)

    def resolve_auto(self, values: Mapping[str, Any]) -> Config:
        """A new config with the given ``"auto"`` key paths replaced (batch re-checked)."""
        return Config.build(substitute_auto(self.source_dict(), type(self), values), self.world_size)

    def require_resolved(self) -> None:
        """Raise :class:`ConfigError` listing every key path that is still ``"auto"``."""
        require_resolved(self)




__all__ = ["AUTO", "Auto", "Config", "ConfigSections"]
