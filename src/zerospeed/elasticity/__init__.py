"""Elastic training's batch arithmetic: DeepSpeed's ``elasticity`` config section (``deepspeed.elasticity``).

With ``"elasticity": {"enabled": true, ...}`` the config gives no batch sizes: :func:`compute_elastic_config`
picks one global batch that splits into whole micro batches at many world sizes, and the engine derives
``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` for the world size it starts at.
A job restarted on fewer (or more) hosts therefore keeps its global batch, and resumes from its
checkpoint with the accumulation re-derived. The launcher side (``--elastic_training``) restarts the
workers; this package is the config and its arithmetic, torch-free so schedulers can import it.
"""

from __future__ import annotations

from .config import ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .constants import ELASTICITY, ENABLED, ENABLED_DEFAULT
from .elasticity import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config
from .utils import is_torch_elastic_compatible

__all__ = ["ELASTICITY", "ENABLED", "ENABLED_DEFAULT", "ElasticityConfig", "ElasticityConfigError", "ElasticityError",
           "ElasticityIncompatibleWorldSize", "compute_elastic_config", "elasticity_enabled",
           "ensure_immutable_elastic_config", "is_torch_elastic_compatible"]
