"""A refused option of the Hugging Face conversion: a
:class:`~lightning_mcore_ckpt.errors.ConfigurationError`.

That class is also Lightning's ``MisconfigurationException``, so importing it imports Lightning
(seconds of CPU). An export, an import or a verification in a process of its own (the command
line) needs none of Lightning: :func:`refused` imports it only once an option is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_mcore_ckpt.errors import ConfigurationError

__all__ = ["refused"]


def refused(message: str) -> ConfigurationError:
    """``ConfigurationError(message)``, to raise.

    Example::

        raise refused("export: adapters='lora' (--adapters): use 'merged' or 'peft'")
    """
    from lightning_mcore_ckpt.errors import ConfigurationError  # imports Lightning

    return ConfigurationError(message)
