"""``ConfigurationError``: a bad option, refused before any work.

Both a ``ValueError`` and Lightning's ``MisconfigurationException``, so that code written for
Lightning (which raises ``MisconfigurationException`` for a misconfigured ``ModelCheckpoint``
or ``Trainer``) and code that catches ``ValueError`` both catch it.

Any layer of the package may import it. Importing it imports Lightning, so the modules that
must stay light without Lightning (``hf``, which the command line's export, import and verify
use) raise it through :func:`lightning_mcore_ckpt.hf._refused.refused`, which imports it only
then.
"""

from __future__ import annotations

from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = ["ConfigurationError"]


class ConfigurationError(MisconfigurationException, ValueError):
    """An option (or a combination of options) that cannot work, named with its value and the
    fix. Raised at construction or at setup, before anything is written.

    Example::

        try:
            MegatronCheckpoint("ckpt", max_to_keep=0)
        except MisconfigurationException as err:  # or: except ValueError
            print(err)  # MegatronCheckpoint(max_to_keep=0): must be a positive int or None
    """
