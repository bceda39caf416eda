"""Builds zerospeed's native CPU optimizer kernels at install time (metadata lives in pyproject.toml).

The extension is optional: where it cannot be compiled, installation still succeeds and
``zerospeed.ops`` uses its pure-PyTorch path (``zerospeed report`` says which one is active and why).
Nothing is ever compiled at run time.
"""

import os

from setuptools import Extension, setup

FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-std=c11"]
if os.environ.get("ZEROSPEED_PORTABLE_BUILD") != "1":  # built on the machine that runs it: use its ISA
    FLAGS += ["-march=native", "-mprefer-vector-width=512"]

setup(ext_modules=[Extension("zerospeed.ops._cpu_optim", sources=["src/zerospeed/ops/csrc/cpu_optim.c"],
                             extra_compile_args=FLAGS, optional=True)])
