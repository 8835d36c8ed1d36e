"""A sampler server (grail-serve, vLLM or SGLang in its own process) behind the Tinker server's
sampler (``grail-tinker --sampler builtin|vllm|sglang``), in the place of the in-process engine.

``ServerEngine`` is what grail/tinker/sampler.py's ``Sampler`` asks of an engine
(``SampleEngine``), done by a server: its ``model`` is a copy of the base model kept here (the
*staging* copy, on the trainer's device), into which the Sampler copies a snapshot's merged
weights (``W_base + (alpha / r) B A``); ``copy_weights`` then sends the staging model to the
server through grail-train's weight routes (``WeightSyncer``: the disk route, or the shared /
NCCL route where the server takes it, disk the fallback), and ``submit`` sends completion
requests through grail-train's ``CompletionClient`` (token ids in and out, the sampler's
log-probabilities).

Why merged full weights and not the server's LoRA slots: a Tinker server's snapshots come from
clients of any rank and module set (the SDK's default trains the output layer too), and a served
LoRA is one shape fixed when the server starts (the built-in engine's layers, vLLM's
``--max-lora-rank``, SGLang's target modules). Full weights have one shape, and the routes that
carry them are the ones grail-train's full fine-tuning uses and tests.

A tied output layer is untied in the staging copy before the server starts (the server loads a
checkpoint with its own ``lm_head.weight``), so that a LoRA on the output layer changes the
output layer alone, as it does in the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from grail.inference import completions
from grail.inference.backends import BACKEND_CLASSES, make_server_manager
from grail.inference.builtin.sampling import SamplingParams
from grail.inference.client import CompletionClient
from grail.inference.process import ServerManager
from grail.inference.weights.policy import PolicyWeights
from grail.inference.weights.route import resolve_route
from grail.inference.weights.syncer import WeightSyncer
from grail.tinker.sampler import untie_output_layer

#: seconds one completion request may take (a whole non-streamed generation)
REQUEST_TIMEOUT_S = 600.0


class ServerEngine:
    """A started sampler server as the Sampler's engine (module docstring). Build it with
    ``start_server_engine``; ``stop()`` stops the server and the client's event loop."""

    def __init__(self, server: ServerManager, syncer: WeightSyncer, model: Any) -> None:
        self.server, self.syncer, self.model = server, syncer, model
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        config = model.config
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 2048)
        # The client lives on its own event loop: the Sampler calls from its thread.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tinker-sampler-client", daemon=True
        )
        self._thread.start()
        self.client = CompletionClient(
            server.base_url,
            server.model_name,
            backend=server.kind,  # type: ignore[arg-type]  # a BACKENDS name, as kind is
            api_key=server.api_key,
            timeout=REQUEST_TIMEOUT_S,
            liveness_check=server.check_alive,
        )

    def copy_weights(
        self, tensors: dict[str, torch.Tensor], weight_version: str, what: str
    ) -> None:
        """Copy ``tensors`` into the staging model, then send the server the whole model (its
        route, disk the fallback). Called with no request in flight (the Sampler waits)."""
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.model.get_parameter(name).copy_(tensor)
        self.syncer.sync(PolicyWeights(self.model), weight_version)

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, n: int = 1, seed: int | None = None
    ) -> list[concurrent.futures.Future[completions.Completion]]:
        """``n`` samples of ``prompt`` in one request; sample i is seeded ``seed + i`` (a random
        seed when None), one future per sample, all done when the answer comes. A server that
        died is restarted first, on the weights it last served (the requests it had fail)."""
        if not self.server.is_alive():
            self.syncer.recover()
        request = self.client.complete(
            list(prompt), n, client_params(params), secrets.randbits(31) if seed is None else seed
        )
        answer = asyncio.run_coroutine_threadsafe(request, self._loop)
        samples: list[concurrent.futures.Future[completions.Completion]] = [
            concurrent.futures.Future() for _ in range(n)
        ]

        def split(done: concurrent.futures.Future[list[completions.Completion]]) -> None:
            error = done.exception()
            for i, sample in enumerate(samples):
                if error is not None:
                    sample.set_exception(error)
                else:
                    sample.set_result(done.result()[i])

        answer.add_done_callback(split)
        return samples

    def stop(self) -> None:
        """Close the client, stop its loop and the server (also after a failed start)."""
        if self._loop.is_running():
            closing = asyncio.run_coroutine_threadsafe(self.client.aclose(), self._loop)
            # a client that cannot close cleanly still has its loop stopped
            with contextlib.suppress(Exception):
                closing.result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        try:
            self.syncer.close()
        finally:
            self.server.stop()


def client_params(params: SamplingParams) -> completions.SamplingParams:
    """The engine's sampling settings as a completion request carries them (top_k 0: off)."""
    return completions.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or -1,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )


def start_server_engine(
    backend: str,
    model_dir: Path,
    directory: Path,
    *,
    load: Callable[[], Any],
    trainer_device: str,
    server_device: str,
    dtype: str,
    weight_transfer: str = "auto",
    threads: int | None = None,
    extra_args: Sequence[str] = (),
    start_timeout: float | None = None,
) -> ServerEngine:
    """Start a ``backend`` server on ``server_device`` from the base model (``load()``: a fresh
    copy, the staging model), written untied into ``directory`` with the tokenizer of
    ``model_dir``, and its route for ``weight_transfer`` (``auto``: as grail-train picks it)."""
    from transformers import AutoTokenizer

    model = load().eval().requires_grad_(False)
    untie_output_layer(model)
    PolicyWeights(model).save(directory)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(directory)
    same_device = _device(trainer_device) == _device(server_device)
    route = resolve_route(
        weight_transfer,
        BACKEND_CLASSES[backend].weight_routes,
        backend=backend,
        strategy="single" if same_device else "multi",
        same_device=same_device,
        lora=False,
        weight_sync="in_place",
    )
    server = make_server_manager(
        backend,
        directory,
        "tinker-sampler",
        log_dir=directory.parent / "logs",
        device=server_device,
        threads=threads,
        dtype=dtype if backend == "builtin" else None,
        shares_gpu_with_trainer=same_device,
        extra_args=extra_args,
        start_timeout=start_timeout,
        weight_transfer=route.name,
    )
    syncer = WeightSyncer.for_server(server, route)
    try:
        server.launch()
        return ServerEngine(server, syncer, model)
    except BaseException:
        syncer.close()
        server.stop()
        raise


def _device(name: str) -> torch.device:
    """``name`` as a device, ``cuda`` spelled ``cuda:0`` (what this process addresses first)."""
    device = torch.device(name)
    return torch.device("cuda", device.index or 0) if device.type == "cuda" else device
