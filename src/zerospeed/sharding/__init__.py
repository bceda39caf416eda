"""Pure plans of who owns which bytes (ZeRO partitioning)."""

from zerospeed.sharding.flat import FlatUnit
from zerospeed.sharding.plan import DEFAULT_ALIGN, ParamSlot, Piece, ShardPlan, UnitPlan

__all__ = ["DEFAULT_ALIGN", "FlatUnit", "ParamSlot", "Piece", "ShardPlan", "UnitPlan"]
