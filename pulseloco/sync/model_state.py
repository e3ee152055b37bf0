"""The tensors a PULSESync subscriber writes: a model's floating-point state, an anchor loaded into it, a BF16
shadow copied back into the model, and the indices an update changed.

A :class:`~pulseloco.sync.subscriber.Subscriber` applies patches and anchors to a BF16 *target*: the model's own
tensors when they are BF16, else a shadow it keeps, which :func:`copy_to_model` copies into the model once a
version is complete. These functions hold no state and take no lock; the subscriber calls them under its lock.

Failure behaviour: :func:`load_anchor_into` raises :class:`~pulseloco.errors.PayloadError` or
:class:`~pulseloco.errors.DigestMismatchError` for an anchor that does not parse or verify, and
:class:`~pulseloco.errors.TensorMismatchError` for one whose tensors differ from the target's, in each case before
it writes anything; the others do not raise for tensors of matching names.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from pulseloco.errors import TensorMismatchError
from pulseloco.sync.anchor import load_anchor
from pulseloco.sync.signing import Envelope

__all__ = ["copy_to_model", "float_state", "load_anchor_into", "union_indices"]


def union_indices(changed: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per tensor, the sorted union of the flat indices several patches wrote."""
    return {
        name: (parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts), sorted=True)).to(torch.int64)
        for name, parts in changed.items()
    }


def float_state(model: torch.nn.Module | MutableMapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point tensors of ``model``'s state dict (or of the mapping itself), by name."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def copy_to_model(
    model: torch.nn.Module | MutableMapping[str, torch.Tensor], target: MutableMapping[str, torch.Tensor]
) -> None:
    """Copy ``target`` (the BF16 state patches were applied to) into ``model``'s floating-point tensors, converting
    dtype and device in place; nothing when ``target`` is the model's own state. Raises :class:`KeyError` for a
    model tensor ``target`` lacks."""
    if target is model:
        return
    state = float_state(model)
    if all(state[k] is target.get(k) for k in state):
        return
    with torch.no_grad():
        for name, t in state.items():
            t.copy_(target[name])  # converts dtype and device in place: no tensor-sized temporary


def load_anchor_into(target: MutableMapping[str, torch.Tensor], env: Envelope, payload: bytes) -> None:
    """Load the anchor ``payload`` (signed by ``env``, whose digest it must match) into ``target``: an empty
    ``target`` adopts the anchor's tensors, any other must have the same names, shapes and dtypes (checked before
    anything is written)."""
    loaded = load_anchor(payload, expected_digest=env.digest)
    if not target:  # an empty state dict adopts the publisher's tensors (``pulseloco sync follow``)
        target.update(loaded)
        return
    if set(loaded) != set(target):
        missing = sorted(set(target) ^ set(loaded))[:5]
        raise TensorMismatchError(f"anchor tensors differ from the model's: {missing}")
    for name, t in loaded.items():
        if t.shape != target[name].shape or t.dtype != target[name].dtype:
            raise TensorMismatchError(f"anchor tensor {name!r} is {t.dtype}{tuple(t.shape)}")
    with torch.no_grad():
        for name, t in loaded.items():
            target[name].copy_(t)
