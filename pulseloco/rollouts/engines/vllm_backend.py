"""The ``pulsesync`` weight-transfer backend of vLLM: how :class:`pulseloco.rollouts.engines.vllm.VLLMEngine` writes a
verified PULSESync version into vLLM's weights, inside vLLM's worker processes.

:func:`register` (the ``vllm.general_plugins`` entry point ``pulseloco.rollouts.engines.vllm:register``, which vLLM
loads in every process it starts) registers :class:`PulseSyncWeightTransferEngine` with vLLM's
``WeightTransferEngineFactory`` under :data:`BACKEND`. Each ``update_weights`` call carries one
:class:`PulseSyncUpdateInfo`: elements of checkpoint tensors (flat indices and their new values) or whole tensors,
in the trainer's ``state_dict`` names. The engine loads them with ``load_checkpoint_weight_patches``, which goes
through the model's own ``load_weights``: checkpoint names are mapped to vLLM's fused and tensor-parallel
parameters there (``qkv_proj``, ``gate_up_proj``, tied embeddings); or, where vLLM repacked its weights after
loading (:func:`needs_layerwise`), with vLLM's layerwise reload of whole tensors.

This module imports without vLLM (the engine's base is then ``object``); :func:`register` and
:func:`needs_layerwise` need it.

Failure behaviour: :meth:`PulseSyncUpdateInfo.tensors` raises ``ValueError`` on anything inconsistent (lengths,
dtypes, sizes); every error of a load propagates to vLLM's caller, :class:`~pulseloco.rollouts.engines.vllm.VLLMEngine`,
which reloads every tensor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BACKEND", "PulseSyncUpdateInfo", "PulseSyncWeightTransferEngine", "needs_layerwise", "register"]

BACKEND = "pulsesync"
"""The name of the weight-transfer backend (``WeightTransferConfig(backend=BACKEND)``)."""


def register() -> None:
    """Register the ``pulsesync`` backend with vLLM (the ``vllm.general_plugins`` entry point; idempotent, since
    vLLM calls it once in every process it starts)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "PulseSyncWeightTransferEngine")


_WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class PulseSyncUpdateInfo:
    """One ``update_weights`` chunk: elements of checkpoint tensors and their new values.

    vLLM's control channel (msgpack) carries untyped tensors only as bytes, so ``values[i]`` holds the raw
    little-endian values of ``dtypes[i]`` and ``indices[i]`` the flat indices as int64 bytes, or None when
    ``values[i]`` is the whole tensor. :meth:`tensors` validates sizes, dtypes and index ranges.
    """

    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    indices: list[bytes | None]
    values: list[bytes]
    layerwise: bool = False

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.shapes) == len(self.dtypes) == len(self.indices) == len(self.values) == n):
            raise ValueError(
                f"update info lists differ in length: {n} names, {len(self.shapes)} shapes, {len(self.dtypes)} "
                f"dtypes, {len(self.indices)} index buffers, {len(self.values)} value buffers"
            )

    def tensors(self) -> list[tuple[str, tuple[int, ...], torch.Tensor | None, torch.Tensor]]:
        """``(name, shape, indices or None, values)`` per entry; raises ValueError on anything inconsistent."""
        out: list[tuple[str, tuple[int, ...], torch.Tensor | None, torch.Tensor]] = []
        for name, shape, dtype_name, idx, val in zip(self.names, self.shapes, self.dtypes, self.indices, self.values):
            dtype = _WIRE_DTYPES.get(dtype_name)
            if dtype is None:
                raise ValueError(f"{name}: dtype {dtype_name!r} is not one of {sorted(_WIRE_DTYPES)}")
            itemsize = torch.empty((), dtype=dtype).element_size()
            numel = math.prod(shape)
            if len(val) % itemsize:
                raise ValueError(f"{name}: {len(val)} value bytes is not a whole number of {dtype_name}")
            values = torch.frombuffer(bytearray(val), dtype=dtype) if val else torch.empty(0, dtype=dtype)
            if idx is None:
                if values.numel() != numel:
                    raise ValueError(f"{name}: {values.numel()} dense values for shape {tuple(shape)}")
                out.append((name, tuple(shape), None, values))
                continue
            if len(idx) != 8 * values.numel():
                raise ValueError(f"{name}: {len(idx) // 8} indices for {values.numel()} values")
            indices = torch.frombuffer(bytearray(idx), dtype=torch.int64) if idx else torch.empty(0, dtype=torch.int64)
            out.append((name, tuple(shape), indices, values))
        return out


def needs_layerwise(model_config: Any) -> bool:
    """Whether vLLM repacks this model's weights after loading, so that elements cannot be written in place:
    always on the CPU build (oneDNN/SGL GEMM layouts), and for quantized models."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu() or getattr(model_config, "quantization", None))


def _worker_engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo

    @dataclass
    class PulseSyncInitInfo(WeightTransferInitInfo):
        """Nothing to set up: updates arrive through ``update_weights`` itself."""

    class Base(WeightTransferEngine[PulseSyncInitInfo, PulseSyncUpdateInfo]):
        init_info_cls = PulseSyncInitInfo
        update_info_cls = PulseSyncUpdateInfo
        supports_draft_weight_update = False

    return Base


try:  # the worker-side class exists only where vLLM is installed (this module imports without it)
    _WorkerEngineBase: type = _worker_engine_base()
except ImportError:  # pragma: no cover - depends on the environment
    _WorkerEngineBase = object


class PulseSyncWeightTransferEngine(_WorkerEngineBase):
    """vLLM's side of the ``pulsesync`` backend: loads checkpoint tensors, or elements of them, through the
    model's ``load_weights``.

    Two ways, chosen by the sender per update (``update_info.layerwise``, see :func:`needs_layerwise`):

    - in place (the engine computes with its parameters as loaded: unquantized weights on a GPU): sparse
      elements go through ``load_checkpoint_weight_patches``' NaN-masked copy, so only they are written; whole
      tensors through the same function's dense path. Shapes, index ranges and duplicates are validated first.
    - layerwise (the engine repacked its weights after loading: the CPU build's oneDNN/SGL layouts, quantized
      engines): whole tensors only, through vLLM's layerwise reload, which rebuilds each layer's processed
      weights once all of its checkpoint tensors arrived; layers that receive nothing keep theirs.

    Errors propagate to the caller (:class:`VLLMEngine`), which reloads every tensor.
    """

    _reloading = False

    def init_transfer_engine(self, init_info: Any) -> None:
        """Nothing to connect: updates carry their tensors."""

    def start_weight_update(self) -> None:
        """Nothing yet: the first chunk says whether this update reloads layerwise."""
        self._reloading = False

    def finish_weight_update(self) -> None:
        """Finish a layerwise reload (processes what was loaded, puts back the layers that received nothing)."""
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            # every layer this update did not touch says "Failed to load weights": expected here, not a failure
            reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            level = reload_logger.level
            reload_logger.setLevel(logging.ERROR)
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                reload_logger.setLevel(level)

    def receive_weights(self, update_info: PulseSyncUpdateInfo) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        entries = update_info.tensors()
        if update_info.layerwise:
            if any(idx is not None for _, _, idx, _ in entries):
                raise ValueError("a layerwise reload takes whole tensors, not elements")
            if not self._reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self._reloading = True
            self.model.load_weights([(name, val.view(shape)) for name, shape, _, val in entries])
            return
        dense: list[Any] = []
        sparse: list[Any] = []
        for name, shape, idx, val in entries:
            patch = CheckpointWeightPatch(name=name, shape=shape, dtype=val.dtype, values=val, indices=idx)
            (dense if idx is None else sparse).append(patch)
        for patches in (dense, sparse):
            if patches:
                load_checkpoint_weight_patches(self.model, patches)

    def shutdown(self) -> None:
        """Nothing held."""
