"""``deepspeed.runtime.base_optimizer``: DeepSpeed's base class of its wrapping optimizers.

zerospeed's engine hands back the torch optimizer itself (over the fp32 masters or their shards),
so nothing derives from this class; it exists because frameworks test ``isinstance`` against it
(Lightning's checkpoint loading) next to ``torch.optim.Optimizer``.
"""


class DeepSpeedOptimizer:
    """Never instantiated by zerospeed; see the module docstring."""


__all__ = ["DeepSpeedOptimizer"]
