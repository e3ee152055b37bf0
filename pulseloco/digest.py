"""State digests, shared by PULSESync (patch digests) and PULSELoCo (``theta_digest``).

The scheme (``DIGEST_SCHEME``): every tensor's bytes are cut into chunks of ``DIGEST_CHUNK_BYTES`` (4 MiB; the
last chunk of a tensor is shorter), each chunk is hashed with xxh3-128, and the digest is the xxh3-128 of, for
every tensor in sorted-name order, its name, its dtype and shape, its chunk count and its chunk hashes. Chunks
are independent, so a state is hashed on every core (:mod:`pulseloco.parallel`), and code that already walks a
state chunk by chunk (:func:`pulseloco.sync.make_patch`, :func:`pulseloco.sync.apply_patch`) hashes each chunk
while it is in cache and reuses the hashes of chunks it did not change.

Two states have the same digest exactly when they have the same names, dtypes, shapes and bit patterns (up to
hash collisions). It is an integrity check, not an authenticator: signatures over patch headers (which carry
digests) provide authenticity.

Tensors on a GPU are hashed one chunk at a time through host memory: the whole state crosses the bus, but the
host never holds more than one chunk of it. A subscriber that follows a GPU model keeps its digest on its CPU
shadow copy instead (docs/design.md, "The GPU path").
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import xxhash

from pulseloco.parallel import parallel_map

logger = logging.getLogger(__name__)

__all__ = [
    "DIGEST_CHUNK_BYTES",
    "DIGEST_SCHEME",
    "chunk_spans",
    "combine_digest",
    "hash_chunk",
    "state_chunk_digests",
    "state_digest",
    "tensor_bytes",
]

#: Bytes of a tensor hashed as one unit (a multiple of 8, so chunks hold whole elements of every dtype).
DIGEST_CHUNK_BYTES = 4 << 20
#: A name for the scheme, for documentation and logs.
DIGEST_SCHEME = "xxh3-128 of per-4MiB-chunk xxh3-128"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a flat uint8 array, copied only when the tensor is not contiguous.

    Raises :class:`ValueError` for a tensor that is not on the CPU (hash those with :func:`state_digest`,
    which moves them one chunk at a time).
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {t.device}")
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def chunk_spans(numel: int, element_size: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, end)`` of the digest chunks of a tensor with ``numel`` elements."""
    step = DIGEST_CHUNK_BYTES // element_size
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def hash_chunk(data: np.ndarray) -> bytes:
    """xxh3-128 of a contiguous array's bytes (releases the GIL, so chunks hash in parallel)."""
    return xxhash.xxh3_128_digest(data.data)


def _meta(name: str, tensor: torch.Tensor) -> bytes:
    encoded = name.encode()
    meta = f"{tensor.dtype}:{tuple(tensor.shape)}".encode()
    return _U32.pack(len(encoded)) + encoded + _U32.pack(len(meta)) + meta


def combine_digest(state: Mapping[str, torch.Tensor], chunk_digests: Mapping[str, Sequence[bytes]]) -> str:
    """The digest of ``state`` from the hashes of its chunks (``chunk_digests[name][i]`` for the i-th chunk of
    :func:`chunk_spans`). Raises :class:`KeyError` when a tensor's hashes are missing."""
    h = xxhash.xxh3_128()
    for name in sorted(state):
        digests = chunk_digests[name]
        h.update(_meta(name, state[name]))
        h.update(_U64.pack(len(digests)))
        h.update(b"".join(digests))
    return h.hexdigest()


def _device_chunk_digests(tensor: torch.Tensor) -> list[bytes]:
    """Chunk hashes of a tensor that is not on the CPU: each chunk is copied to the host on its own."""
    flat = tensor.detach().reshape(-1)
    digests = []
    for start, end in chunk_spans(flat.numel(), flat.element_size()):
        digests.append(hash_chunk(flat[start:end].cpu().view(torch.uint8).numpy()))
    return digests


def state_chunk_digests(
    state: Mapping[str, torch.Tensor], *, names: Sequence[str] | None = None
) -> dict[str, list[bytes]]:
    """The chunk hashes of every tensor of ``state`` (or of ``names``), CPU chunks hashed in parallel.

    Raises :class:`TypeError` if a value is not a tensor.
    """
    wanted = sorted(state) if names is None else list(names)
    jobs: list[tuple[str, int, np.ndarray]] = []
    out: dict[str, list[bytes]] = {}
    for name in wanted:
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state[{name!r}] is {type(tensor).__name__}, not a tensor")
        if tensor.device.type != "cpu":
            out[name] = _device_chunk_digests(tensor)
            continue
        data = tensor_bytes(tensor)
        spans = chunk_spans(tensor.numel(), tensor.element_size())
        out[name] = [b""] * len(spans)
        size = tensor.element_size()
        for i, (start, end) in enumerate(spans):
            jobs.append((name, i, data[start * size : end * size]))
    for (name, i, _), digest in zip(jobs, parallel_map(lambda job: hash_chunk(job[2]), jobs), strict=True):
        out[name][i] = digest
    return out


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """Hex digest of ``state`` (a ``state_dict()``-like mapping of names to tensors; see the module docstring).

    Raises :class:`TypeError` if a value is not a tensor.
    """
    return combine_digest(state, state_chunk_digests(state))
