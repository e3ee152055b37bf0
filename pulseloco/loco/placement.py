"""Where PULSELoCo's outer state lives, and how the model's parameters move to and from it, chunk by chunk.

The outer state (``theta``, the residual, the outer momentum: flat FP32 vectors over the trainable parameters) is kept
in host memory (pinned for a model on a CUDA GPU, so that the chunked copies run asynchronously on a side stream) or on
the model's GPU (``outer_state_device="model"``). :class:`OuterPlacement` allocates it, copies the parameters into it
chunk by chunk (:meth:`OuterPlacement.local_chunks`) and back (:meth:`OuterPlacement.load_into_model`), and broadcasts
``theta`` from rank 0 in a multi-process launch. Temporaries are bounded by a few chunks, never the model. Both
placements give bit-identical results.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, get_args

import torch

from pulseloco.errors import ConfigError

__all__ = ["OUTER_STATE_DEVICES", "OuterPlacement", "OuterStateDevice", "process_group"]

OuterStateDevice = Literal["auto", "cpu", "model"]
OUTER_STATE_DEVICES: tuple[OuterStateDevice, ...] = get_args(OuterStateDevice)
"""Where :class:`PulseLoCo` keeps its outer state (``theta``, residual, outer momentum: 12 bytes a parameter)."""


def process_group() -> tuple[int, int]:
    """(world size, this process's rank) of the initialized ``torch.distributed`` group; (1, 0) without one."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1, 0
    return torch.distributed.get_world_size(), torch.distributed.get_rank()


class OuterPlacement:
    """The flat parameter space of ``params`` (trainable parameters, in order) and where its FP32 outer state lives.

    ``outer_state_device``: ``"auto"``/``"cpu"`` (host memory, pinned for a model on a GPU) or ``"model"`` (the
    model's GPU; host memory for a model on the CPU). ``chunk_numel``: FP32 entries of one chunk of the chunked
    transfers. Raises nothing at construction; :meth:`empty` raises :class:`ConfigError` when a state does not fit.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], outer_state_device: OuterStateDevice, chunk_numel: int
    ) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        model_device = params[0].device
        self.model_device = model_device if model_device.type == "cuda" else torch.device("cpu")
        """The device the parameters are on (CUDA), or the CPU."""
        on_gpu = self.model_device.type == "cuda"
        self.device = self.model_device if outer_state_device == "model" and on_gpu else torch.device("cpu")
        """Where the outer state lives (see ``outer_state_device``)."""
        self.pin_memory = on_gpu and self.device.type == "cpu" and torch.cuda.is_available()
        """Whether the outer state and the staging chunks are pinned host memory."""
        self.chunk_numel = chunk_numel
        # The host <-> GPU copies run on their own stream, so they queue without waiting for each other.
        self._copy_stream = torch.cuda.Stream(self.model_device) if self.pin_memory else None
        self._staging: list[torch.Tensor] = []

    def empty(self, what: str) -> torch.Tensor:
        """An uninitialized flat FP32 tensor of the outer state, where ``outer_state_device`` puts it. Raises
        :class:`ConfigError` when it does not fit (GPU memory, or pinned host memory)."""
        try:
            return torch.empty(self.numel, dtype=torch.float32, device=self.device, pin_memory=self.pin_memory)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError, or cudaHostAlloc failing for pinned memory
            where = "pinned host memory" if self.pin_memory else str(self.device)
            hint = "outer_state_device='cpu'" if self.device.type == "cuda" else "a host with more memory"
            raise ConfigError(
                f"PulseLoCo's {what} ({4 * self.numel / 2**30:.2f} GiB, FP32) does not fit in {where}: "
                f"{' '.join(str(exc).split())[:200]}; use {hint}"
            ) from exc

    def place(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """A copy of a flat FP32 ``tensor`` in the outer state's memory (:meth:`empty`)."""
        out = self.empty(what)
        out.copy_(tensor.detach())
        return out

    def pieces(self, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        """The parts of the trainable parameters in flat range ``[start, stop)``: ``(flat view, lo, hi)`` with
        ``lo, hi`` relative to ``start``. Non-contiguous parameters come whole, in the chunk where they begin."""
        offset = 0
        for p in self.params:
            n = p.numel()
            if offset >= stop:
                return
            if offset + n > start and n:
                if p.is_contiguous():
                    a, b = max(start, offset), min(stop, offset + n)
                    yield p.detach().view(-1)[a - offset : b - offset], a - start, b - start
                elif offset >= start:
                    yield p.detach(), offset - start, offset + n - start
            offset += n

    def chunk_ranges(self) -> Iterator[tuple[int, int]]:
        """Chunk ranges of the flat parameter space (non-contiguous parameters stretch the chunk they begin in)."""
        start = 0
        while start < self.numel:
            stop = min(start + self.chunk_numel, self.numel)
            offset = 0
            for p in self.params:  # a non-contiguous parameter beginning here moves the end past it
                n = p.numel()
                if start <= offset < stop and not p.is_contiguous():
                    stop = max(stop, offset + n)
                offset += n
            yield start, stop
            start = stop

    def _staging_buffer(self, index: int, numel: int) -> torch.Tensor:
        """Staging chunk ``index`` (0 or 1) of at least ``numel`` FP32 entries, kept for the next rounds."""
        while len(self._staging) <= index:
            self._staging.append(torch.empty(0, dtype=torch.float32))
        if self._staging[index].numel() < numel:
            self._staging[index] = torch.empty(
                max(numel, self.chunk_numel), dtype=torch.float32, device=self.device, pin_memory=self.pin_memory
            )
        return self._staging[index][:numel]

    def local_chunks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The local parameters as FP32 on the outer state's device, chunk by chunk: ``(start, stop, local_chunk)``.

        ``local_chunk`` is a staging buffer, valid until the generator is resumed: with pinned memory the next
        chunk's copy from the GPU is queued (on a side stream) while the caller works on this one."""
        ranges = list(self.chunk_ranges())
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.model_device))  # the inner steps wrote the params

        def fill(j: int) -> tuple[torch.Tensor, Any]:
            start, stop = ranges[j]
            buffer = self._staging_buffer(j % 2, stop - start)
            if stream is None:
                for piece, lo, hi in self.pieces(start, stop):
                    buffer[lo:hi].view_as(piece).copy_(piece)
                return buffer, None
            with torch.cuda.stream(stream):
                for piece, lo, hi in self.pieces(start, stop):
                    buffer[lo:hi].view_as(piece).copy_(piece, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            return buffer, event

        with torch.no_grad():
            queued = [fill(0)] if ranges else []
            for j, (start, stop) in enumerate(ranges):
                if j + 1 < len(ranges):
                    queued.append(fill(j + 1))
                buffer, event = queued.pop(0)
                if event is not None:
                    event.synchronize()
                yield start, stop, buffer

    def flatten_local(self, what: str = "local copy") -> torch.Tensor:
        """A full FP32 copy of the local parameters in the outer state's memory (:meth:`empty`; ``what`` names it
        in the error when it does not fit), filled chunk by chunk."""
        flat_N = self.empty(what)
        for start, stop, local_chunk in self.local_chunks():
            flat_N[start:stop].copy_(local_chunk)
        return flat_N

    def load_into_model(self, theta_N: torch.Tensor) -> None:
        """Copy ``theta_N`` into the model's parameters, chunk by chunk (asynchronous copies from pinned memory on a
        side stream, waited for once at the end); temporaries of one chunk at most."""
        stream = self._copy_stream
        with torch.no_grad():
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.model_device))  # pending uses of the params
            for start, stop in self.chunk_ranges():
                for piece, lo, hi in self.pieces(start, stop):
                    source = theta_N[start + lo : start + hi].view_as(piece)
                    if stream is None:
                        piece.copy_(source)
                    else:
                        with torch.cuda.stream(stream):
                            piece.copy_(source, non_blocking=True)
            if stream is not None:
                torch.cuda.current_stream(self.model_device).wait_stream(stream)
                stream.synchronize()  # theta may change once the copies are done, not before

    def broadcast(self, theta_N: torch.Tensor) -> None:
        """Rank 0's ``theta_N`` to every rank of an initialized ``torch.distributed`` group (nothing without one).
        A host ``theta_N`` under a backend that cannot send host tensors (NCCL) goes chunk by chunk through a
        buffer on the model's GPU."""
        world_size, rank = process_group()
        if world_size == 1:
            return
        if theta_N.device.type == "cpu" and "nccl" in str(torch.distributed.get_backend()).lower():
            for start, stop in self.chunk_ranges():
                staging = theta_N[start:stop].to(self.model_device)
                torch.distributed.broadcast(staging, src=0)
                if rank != 0:  # rank 0's theta may be shared with the served snapshot
                    theta_N[start:stop].copy_(staging)
            return
        torch.distributed.broadcast(theta_N, src=0)
