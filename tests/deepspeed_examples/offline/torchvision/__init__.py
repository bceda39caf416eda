"""Test double for torchvision (test-only; see tests/deepspeed_examples/README.md).

PyPI has no CPU build of torchvision for this torch, so the example scripts get this stand-in with
the few names they use. Datasets read files the test generated in the real on-disk format and never
download; transforms compute what torchvision's do.
"""

from . import datasets, transforms

__version__ = "0.0.0+zerospeed.testdouble"
__all__ = ["datasets", "transforms"]
