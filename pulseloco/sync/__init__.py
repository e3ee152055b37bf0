"""PULSESync: lossless sparse BF16 weight patches from a trainer to rollout workers.

Public API::

    from pulseloco.sync import make_patch, apply_patch, state_digest, squash

Importing this package is cheap: the public names load torch on first use, so that a submodule that does not need
torch (``pulseloco.sync.signing``, behind ``pulseloco keygen``) is imported without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pulseloco._lazy import lazy_attributes

if TYPE_CHECKING:
    from pulseloco.digest import state_digest
    from pulseloco.sync.patch import PATCH_VALUE_MODES, PatchInfo, apply_patch, make_patch, squash

__all__ = ["PATCH_VALUE_MODES", "PatchInfo", "apply_patch", "make_patch", "squash", "state_digest"]

_LAZY = {name: "pulseloco.sync.patch" for name in __all__} | {"state_digest": "pulseloco.digest"}


__getattr__ = lazy_attributes(__name__, _LAZY)
