"""PULSESync: lossless sparse BF16 weight patches from a trainer to rollout workers.

Public API::

    from pulseloco.sync import make_patch, apply_patch, state_digest, squash
"""

from pulseloco.digest import state_digest
from pulseloco.sync.patch import PATCH_VALUE_MODES, PatchInfo, apply_patch, make_patch, squash

__all__ = ["PATCH_VALUE_MODES", "PatchInfo", "apply_patch", "make_patch", "squash", "state_digest"]
