"""Builds zerospeed's native CPU kernels (optimizers, int8 matmul) at install time (metadata lives in pyproject.toml).

The extension is optional: where it cannot be compiled, installation still succeeds and
``zerospeed.ops`` uses its pure-PyTorch path (``zerospeed report`` says which one is active and why).
Nothing is ever compiled at run time.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-std=c11"]
if os.environ.get("ZEROSPEED_PORTABLE_BUILD") != "1":  # built on the machine that runs it: use its ISA
    FLAGS += ["-march=native", "-mprefer-vector-width=512"]

# ``ZEROSPEED_AS_DEEPSPEED=1`` works at interpreter start through this file in site-packages.
PTH = "zerospeed_as_deepspeed.pth"


class BuildPyWithPth(build_py):
    """Also place the ``.pth`` hook at the top of the wheel (site-packages), beside the package."""

    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("src", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """``pip install -e``: put the same ``.pth`` hook in the editable wheel's root (site-packages).

    setuptools has no public hook for extra top-level files of an editable wheel; the directory it
    unpacks into the wheel is handed to ``_install_namespaces``, so the file is added there."""

    def _install_namespaces(self, installation_dir: str, pth_prefix: str) -> None:
        super()._install_namespaces(installation_dir, pth_prefix)
        self.copy_file(os.path.join("src", PTH), os.path.join(installation_dir, PTH))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
      ext_modules=[Extension("zerospeed.ops._cpu_optim", sources=["src/zerospeed/ops/csrc/cpu_optim.c"],
                             extra_compile_args=FLAGS, optional=True),
                   # OpenMP: the runtime torch already loaded (libgomp.so.1, same soname) runs its threads
                   Extension("zerospeed.ops._int8_gemm", sources=["src/zerospeed/ops/csrc/int8_gemm.c"],
                             extra_compile_args=[*FLAGS, "-fopenmp"], extra_link_args=["-fopenmp"], optional=True)])
