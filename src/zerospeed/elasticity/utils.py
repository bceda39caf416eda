"""``deepspeed.elasticity.utils``: whether torch has the elastic agent elastic training runs under."""

from __future__ import annotations


def is_torch_elastic_compatible() -> bool:
    """True: torch's elastic agent arrived in torch 1.11 and zerospeed needs torch 2.4 or newer."""
    return True


__all__ = ["is_torch_elastic_compatible"]
