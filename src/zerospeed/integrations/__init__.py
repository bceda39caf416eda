"""zerospeed inside other training frameworks.

Each integration is its own module and imports its framework, so ``import zerospeed`` never pulls in an
optional dependency:

- :mod:`zerospeed.integrations.hf`: the one Accelerate shim ``install_as_deepspeed`` installs (Accelerate +
  DeepSpeed on a CPU-only machine); the HF Trainer and Accelerate otherwise run through the alias unchanged;
- :mod:`zerospeed.integrations.lightning`: ``ZeroSpeedStrategy`` for PyTorch Lightning's ``Trainer``
  (registered as ``strategy="zerospeed"``);
- :mod:`zerospeed.integrations.lightning_fabric`: ``ZeroSpeedFabricStrategy`` for Lightning Fabric;
- :mod:`zerospeed.integrations.lightning_precision`: their precision plugins;
- :mod:`zerospeed.integrations.lightning_config`: the Lightning-flags-to-config mapping (no Lightning import).
"""
