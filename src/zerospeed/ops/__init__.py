"""Kernels: CPU optimizers (``zerospeed.ops.adam.CPUAdam``, ``adagrad.CPUAdagrad``, ``lion.CPULion``).

Native kernels are built when the package is installed, never at run time; without them the same
optimizers run a pure-PyTorch path (``zerospeed report`` says which is active and why).
"""
