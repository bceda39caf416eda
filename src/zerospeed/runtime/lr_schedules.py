"""``deepspeed.runtime.lr_schedules``: zerospeed's LR schedules under DeepSpeed's module path."""

from zerospeed.lr_schedules import *  # noqa: F401,F403
from zerospeed.lr_schedules import __all__  # noqa: F401
