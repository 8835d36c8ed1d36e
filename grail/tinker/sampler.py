"""The sampling side of the Tinker server: an engine fed the weights of whichever snapshot a
request samples from. The engine is grail's built-in engine (grail/inference/builtin/engine.py) in
this process by default, or a sampler server in its own process (grail-serve, vLLM or SGLang,
``--sampler``; grail/tinker/server_sampler.py), both behind ``SampleEngine``.

Why the in-process engine by default: a sampling client names a snapshot of one training
client's adapter (or the base model), and requests for different snapshots interleave. The engine
holds its own copy of the base model (so sampling never waits for a training pass), and a
snapshot is loaded into it as merged weights: for each layer the snapshot's LoRA touches,
``W = W_base + (alpha / r) B A``, copied in place between batches (the engine's weight route for
in-memory tensors), layers a previous snapshot touched going back to ``W_base``. Loading costs one
copy of the LoRA layers, and only when the snapshot changes. A server sampler gets the same merged
weights through grail-train's weight routes (disk, shared tensors, NCCL).

What the engine guarantees carries over (docs/protocols.md): sample i of a request with seed s
draws from a generator seeded s + i; a sampled token's logprob is ``log_softmax(logits / T)``
before top-k / top-p; EOS and stop tokens stay in the returned tokens.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file

from grail.inference.builtin.engine import Engine
from grail.inference.builtin.sampling import SamplingParams
from grail.tinker import wire
from grail.tinker.errors import NotFound, UserFault
from grail.tinker.trainer import ADAPTER_WEIGHTS, LORA_ALPHA, read_lora_spec

# Ephemeral snapshots (save_weights_and_get_sampling_client) kept in memory; older ones are
# released and their sampling clients get a clear error.
MAX_EPHEMERAL = 32
MAX_SAMPLES = 128
_PEFT_PREFIX = "base_model.model."


class SampleEngine(Protocol):
    """What the Sampler needs of an engine: the model to merge snapshots into (the engine's own,
    or a server sampler's staging copy), copying weights into what samples, and sampling."""

    model: Any
    device: torch.device
    vocab_size: int
    max_model_len: int

    def copy_weights(self, tensors: dict[str, torch.Tensor], weight_version: str, what: str) -> Any:
        """Put ``tensors`` (parameter name -> value) into the model that samples."""

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, n: int = 1, seed: int | None = None
    ) -> Sequence[concurrent.futures.Future[Any]]:
        """``n`` samples of ``prompt``, sample i seeded ``seed + i``: one future each."""

    def stop(self) -> None: ...


@dataclass
class Snapshot:
    """A LoRA adapter's tensors (peft file names) and its scale alpha / r."""

    tensors: dict[str, torch.Tensor]
    scale: float

    def deltas(self) -> dict[str, torch.Tensor]:
        """{module path: scale * B @ A} for each layer the adapter touches."""
        out = {}
        for name, a in self.tensors.items():
            if ".lora_A." not in name:
                continue
            module = name.removeprefix(_PEFT_PREFIX).split(".lora_A.")[0]
            b = self.tensors[name.replace(".lora_A.", ".lora_B.")]
            out[module] = self.scale * (b.float() @ a.float())
        return out


@dataclass
class Session:
    base_model: str
    model_path: str | None
    snapshot: str | None  # key into Sampler.snapshots; None: the base model


@dataclass
class SampleJob:
    session: Session
    prompt: list[int]
    params: SamplingParams
    num_samples: int
    seed: int | None
    prompt_logprobs: bool
    last_n: int | None


class Sampler:
    def __init__(self, engine: SampleEngine, base_model: str, resolve_path: Any) -> None:
        self.engine, self.base_model = engine, base_model
        self.resolve_path = resolve_path  # tinker:// path -> directory (the app's checkpoints)
        self.sessions: dict[str, Session] = {}
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self._ephemeral = 0
        # Ids unique across restarts: a sampling client that outlived one gets a 404, never
        # another client's session of the same number.
        self._start = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self.lock = threading.Lock()
        self._loaded: str | None = None  # the snapshot in the engine; None: base weights
        self._base: dict[str, torch.Tensor] = {}  # W_base of every layer a snapshot touched
        self._inflight: list[concurrent.futures.Future[Any]] = []  # the engine's, not yet done

    # ---- sessions (event loop and job thread) ---------------------------------------------------

    def add_session(self, snapshot: str | None, model_path: str | None) -> str:
        session_id = f"sampler-{self._start}-{next(self._ids)}"
        with self.lock:
            self.sessions[session_id] = Session(self.base_model, model_path, snapshot)
        return session_id

    def session(self, session_id: str) -> Session:
        with self.lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown sampling session {session_id!r}")
        return session

    def add_ephemeral(self, snapshot: Snapshot) -> str:
        """Keep an unnamed snapshot in memory (the newest MAX_EPHEMERAL)."""
        with self.lock:
            self._ephemeral += 1
            key = f"ephemeral-{self._ephemeral}"
            self.snapshots[key] = snapshot
            ephemeral = [k for k in self.snapshots if k.startswith("ephemeral-")]
            for old in ephemeral[:-MAX_EPHEMERAL]:
                del self.snapshots[old]
        return key

    def session_for_path(self, model_path: str) -> str:
        """A sampling session over saved sampler weights (``tinker://<model>/sampler_weights/
        <name>``), read from disk now so a bad path fails here."""
        directory = self.resolve_path(model_path, "sampler_weights")
        return self.add_session(self.snapshot_of(model_path, directory), model_path)

    def snapshot_of(self, model_path: str, directory: Path) -> str:
        """The key of the snapshot saved in ``directory``: its path and the file's time, so
        that weights saved anew under the same name are a new snapshot (read once each)."""
        weights = directory / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise NotFound(f"{model_path}: no {ADAPTER_WEIGHTS} in {directory}")
        key = f"{model_path}@{weights.stat().st_mtime_ns}"
        with self.lock:
            if key in self.snapshots:
                return key
        spec = read_lora_spec(directory)
        snapshot = Snapshot(load_file(str(weights)), LORA_ALPHA / spec.rank)
        with self.lock:
            self.snapshots[key] = snapshot
        return key

    # ---- checks before queueing -------------------------------------------------------------

    def check(self, job: SampleJob) -> None:
        if not job.prompt:
            raise UserFault("the prompt is empty")
        vocab = self.engine.vocab_size
        if min(job.prompt) < 0 or max(job.prompt) >= vocab:
            raise UserFault(f"prompt token ids must be in [0, {vocab})")
        if not 1 <= job.num_samples <= MAX_SAMPLES:
            raise UserFault(f"num_samples must be in [1, {MAX_SAMPLES}], got {job.num_samples}")
        context = self.engine.max_model_len
        if len(job.prompt) + job.params.max_tokens > context:
            raise UserFault(
                f"prompt ({len(job.prompt)} tokens) + max_tokens ({job.params.max_tokens}) is "
                f"over the model's context of {context} tokens"
            )
        if job.last_n is not None and not 1 <= job.last_n <= len(job.prompt) - 1:
            raise UserFault(
                f"prompt_logprobs_last_n must be in [1, {len(job.prompt) - 1}], got {job.last_n}"
            )

    # ---- the sampler thread -------------------------------------------------------------------

    def serve(self, job: SampleJob, finish: Callable[[bytes | Exception], None]) -> None:
        """Start ``job`` (on the sampler thread, in arrival order); ``finish`` gets its
        SampleResponse body or its error, from the engine's thread when its samples are done.

        Jobs of the snapshot the engine holds go straight to the engine, which batches them with
        what it is decoding (continuous batching), so requests sent one by one still share
        batches. A job of another snapshot first waits for the jobs in flight (a batch never
        mixes weights), and so does one that asks for prompt log-probabilities (computed here,
        with the engine idle)."""
        key = job.session.snapshot
        if key != self._loaded or job.prompt_logprobs:
            concurrent.futures.wait(self._inflight)
        self._inflight = [f for f in self._inflight if not f.done()]
        try:
            self._load(key)
            futures = list(self.engine.submit(job.prompt, job.params, job.num_samples, job.seed))
        except Exception as exc:
            finish(exc)
            return
        if job.prompt_logprobs:
            concurrent.futures.wait(futures)
            finish(self._response(job, futures))
            return
        self._inflight.extend(futures)
        remaining = [len(futures)]
        lock = threading.Lock()

        def done(_: concurrent.futures.Future[Any]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                finish(self._response(job, futures))

        for future in futures:
            future.add_done_callback(done)

    def run(self, jobs: Sequence[SampleJob]) -> list[bytes | Exception]:
        """Serve ``jobs`` and wait for all of them (what ``serve`` does, for a caller in this
        process: the overhead benchmark's direct side)."""
        results: list[bytes | Exception] = [UserFault("not run")] * len(jobs)
        for i, job in enumerate(jobs):

            def finish(outcome: bytes | Exception, i: int = i) -> None:
                results[i] = outcome

            self.serve(job, finish)
        concurrent.futures.wait(self._inflight)
        return results

    def _response(
        self, job: SampleJob, futures: list[concurrent.futures.Future[Any]]
    ) -> bytes | Exception:
        try:
            outs = [f.result() for f in futures]
            seqs = [wire.Sequence(o.token_ids, o.logprobs, o.finish_reason == "stop") for o in outs]
            prompt_lp = self._prompt_logprobs(job) if job.prompt_logprobs else None
            return wire.write_sample_response(seqs, prompt_lp)
        except Exception as exc:
            return exc

    def _load(self, key: str | None) -> None:
        if key == self._loaded:
            return
        if key is None:
            deltas: dict[str, torch.Tensor] = {}
        else:
            with self.lock:
                snapshot = self.snapshots.get(key)
            if snapshot is None:
                raise NotFound(
                    f"the weights of this sampling client ({key}) were released (only the newest "
                    f"{MAX_EPHEMERAL} unnamed snapshots are kept); create a new sampling client"
                )
            deltas = snapshot.deltas()
        model = self.engine.model
        if "lm_head" in deltas:
            # the engine is idle: nothing is queued while the sampler thread waits
            untie_output_layer(model)
        tensors = {}
        for module in set(self._base) | set(deltas):
            name = f"{module}.weight"
            if module not in self._base:
                layer: Any = model.get_submodule(module)
                self._base[module] = layer.weight.detach().clone()
            base = self._base[module]
            delta = deltas.get(module)
            tensors[name] = base if delta is None else (base.float() + delta).to(base.dtype)
        if tensors:
            self.engine.copy_weights(tensors, key or "base", "merged LoRA snapshot")
        self._loaded = key

    def _prompt_logprobs(self, job: SampleJob) -> list[float]:
        """log p(prompt[t] | prompt[:t]) for t >= 1 (NaN at 0, and before the last n)."""
        ids = torch.tensor([job.prompt], device=self.engine.device)
        with torch.inference_mode():
            logits = self.engine.model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        values = [math.nan, *logp.cpu().tolist()]
        if job.last_n is not None:
            cut = len(values) - job.last_n
            values[:cut] = [math.nan] * cut
        return values


def untie_output_layer(model: Any) -> None:
    """Give a tied output layer its own copy of the embedding, so that a LoRA on it leaves the
    input embeddings alone (a no-op for an untied model)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False


def sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """The engine's settings from the SDK's SamplingParams (JSON), refusing what it cannot do."""
    max_tokens = raw.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserFault(
            f"sampling_params.max_tokens must be a positive integer, got {max_tokens!r}"
        )
    temperature = float(raw.get("temperature", 1.0))
    top_p = float(raw.get("top_p", 1.0))
    top_k = int(raw.get("top_k", -1))
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserFault(f"sampling_params.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise UserFault(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    if top_k < -1 or top_k == 0:
        raise UserFault(f"sampling_params.top_k must be -1 (off) or >= 1, got {top_k}")
    stop = raw.get("stop")
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
    elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        token_ids = tuple(stop)
    elif stop is not None:
        raise UserFault("sampling_params.stop must be a string, a list of strings or of token ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        stop=strings,
        stop_token_ids=token_ids,
        # The SDK's `stop=[]` turns every stop off, EOS included; None keeps EOS.
        ignore_eos=stop == [],
    )


def engine_for(
    model_dir: Path, device: str, max_model_len: int | None, dtype: str | None = None
) -> Engine:
    """The built-in engine over ``model_dir``, started (``dtype``: the trainer's, so that the
    sampler's log-probabilities are the learner's)."""
    engine = Engine(model_dir, device=device, dtype=dtype, max_model_len=max_model_len)
    engine.start()
    return engine
