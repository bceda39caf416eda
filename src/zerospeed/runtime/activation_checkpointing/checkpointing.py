"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the same functions as
``zerospeed.checkpointing`` (``deepspeed.checkpointing``)."""

from zerospeed.checkpointing import *  # noqa: F401,F403
from zerospeed.checkpointing import __all__  # noqa: F401
