"""DeepSpeed entry points whose capability zerospeed has not built yet: they refuse by name, with
the way forward, instead of being missing attributes (scripts probe for them with ``hasattr``...).

Empty for now: ``init_inference`` lives in :mod:`zerospeed.inference` since issue 20.
"""

from __future__ import annotations

__all__: list[str] = []
