"""``grail-serve`` (``python -m grail.inference.builtin.server``): the process that loads the
built-in generation engine (`engine`) and serves its OpenAI-compatible app (`app`, where the
routes and the protocol are described) with uvicorn. Flags: `parse_args`; the limits flags are
`admission.Limits`'s fields.

The key: ``--api-key``, else ``$GRAIL_API_KEY`` (how grail starts it: a command line is visible to
every local user in ``ps``). Without a key, it serves on a loopback address only, unless
``--insecure-no-api-key`` says otherwise (`check_exposure`); even then the weight routes answer
this machine's loopback only (`app.STATE_ROUTES`).

The server's parts: `app` (the FastAPI app and its routes), `schema` (request bodies),
`validation` (a request's fields checked and turned into engine inputs), `admission` (limits and
the engine's queue), `answers` (response bodies), `tensor_update` (the zero-copy weight route).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grail.core.errors import ConfigError
from grail.core.http_api import is_loopback
from grail.core.reproducible import apply_reproducible_env, check_torch_honours
from grail.inference.builtin import API_KEY_ENV
from grail.inference.builtin.admission import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_BYTES,
    QUEUED_BATCHES,
    Limits,
)

if TYPE_CHECKING:
    import uvicorn

# torch, transformers, uvicorn and the engine are imported in `main` once the flags are checked,
# so that --help and a bad flag answer at once (they took ~6 s of imports).


def _ready_server(config: uvicorn.Config, ready_line: str) -> uvicorn.Server:
    """uvicorn's server, printing `ready_line` (`{url}` filled in) once the socket listens."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(ready_line.format(url=f"http://{host}:{port}"), flush=True)

    return Server(config)


def _positive(text: str) -> int:
    """argparse type of the limit flags."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="grail-serve", description="OpenAI-compatible server for an HF causal LM directory."
    )
    parser.add_argument(
        "--model",
        required=True,
        help="HF model directory, or 'tiny': the offline tiny model (grail-train's default)",
    )
    parser.add_argument("--served-model-name", help="name clients send (default: dir name)")
    parser.add_argument(
        "--lora-dir",
        help="a peft LoRA adapter directory served over the model (its layers are added at "
        "start; POST /update_weights_from_disk with an adapter directory swaps the adapter)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument(
        "--api-key",
        help=f"Bearer key every route but GET /health requires (default: ${API_KEY_ENV}, else "
        f"none; prefer ${API_KEY_ENV}: a command line is visible to every user in ps)",
    )
    parser.add_argument(
        "--insecure-no-api-key",
        action="store_true",
        help="serve on a non-loopback --host without a key: generation is open to the network "
        "(the weight routes still answer this machine's loopback only)",
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=256, help="sequences decoded together at most"
    )
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="results independent of batch composition (default: on for CPU, off for CUDA)",
    )
    parser.add_argument(
        "--decode",
        choices=["eager", "static", "graph"],
        help="decode path: graph (static KV cache + CUDA graphs; default on CUDA), static (the "
        "same without graphs), eager (default on CPU; the only batch-invariant one)",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=1024.0,
        help="memory for the keys and values of finished sequences, which a request that "
        "continues one (an episode's next turn, sent with sampled_spans) reuses bit for bit; "
        "counted by their tokens (they share their batch's tensors: up to ~2x that in all); "
        "batch-invariant decoding only; 0 keeps nothing: such requests are computed again, to "
        "the same numbers (default: 1024)",
    )
    parser.add_argument(
        "--reproducible",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch's AVX2 CPU kernels and MKL's COMPATIBLE branch, as grail-train's "
        "reproducible=true (its default) pins them: the same numbers on any x86-64 CPU with AVX2 "
        "of one vendor, and a run's on a server started by hand; --no-reproducible for a "
        "reproducible=false run (grail/core/reproducible.py)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    limits = parser.add_argument_group("limits (see docs/protocols.md)")
    limits.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 before they are read (default: 8 MiB)",
    )
    limits.add_argument(
        "--max-n",
        type=_positive,
        default=DEFAULT_MAX_N,
        help="samples per prompt (default: %(default)s)",
    )
    limits.add_argument(
        "--max-request-tokens",
        type=_positive,
        help="prompts x n x max_tokens of one request (default: --max-batch-size x the context "
        "length, one full batch)",
    )
    limits.add_argument(
        "--max-queued-seqs",
        type=_positive,
        help=f"sequences waiting or decoding; more get 503 (default: {QUEUED_BATCHES} x "
        "--max-batch-size)",
    )
    return parser.parse_args(argv)


def api_key(args: argparse.Namespace) -> str | None:
    """The server's key: ``--api-key``, else ``$GRAIL_API_KEY`` (unset or empty: none).
    Raises ValueError for a blank key (an empty ``--api-key``, spaces), which anyone could send."""
    if args.api_key is not None:
        key, where = args.api_key, "--api-key"
    else:
        key, where = os.environ.get(API_KEY_ENV) or None, f"${API_KEY_ENV}"
    if key is not None and not key.strip():
        raise ValueError(f"{where} must not be blank")
    return key


def check_exposure(host: str, key: str | None, insecure: bool) -> str | None:
    """Why serving on `host` without a key is refused (one line), or None when it is not."""
    if key is not None or is_loopback(host) or insecure:
        return None
    return (
        f"refusing to serve on --host {host} without an API key: every route would be open to "
        f"the network. Set ${API_KEY_ENV} (or --api-key), serve on 127.0.0.1, or pass "
        "--insecure-no-api-key to open generation only (the weight routes stay loopback-only)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reproducible:  # before torch's first operation, when torch and MKL read them
        apply_reproducible_env(os.environ)
    try:
        key = api_key(args)
    except ValueError as exc:
        print(f"grail-serve: {exc}", file=sys.stderr, flush=True)
        return 2
    refused = check_exposure(args.host, key, args.insecure_no_api_key)
    if refused is not None:
        print(f"grail-serve: {refused}", file=sys.stderr, flush=True)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"grail-serve: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import torch
    import transformers
    import uvicorn

    from grail.inference.builtin.app import create_app
    from grail.inference.builtin.engine import Engine

    transformers.utils.logging.disable_progress_bar()
    if key is None and not is_loopback(args.host):
        logging.getLogger("grail.serve").warning(
            "serving on %s without an API key (--insecure-no-api-key): anyone who reaches the "
            "port can generate; the weight routes answer this machine's loopback only",
            args.host,
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.reproducible:
        try:
            check_torch_honours()
        except ConfigError as exc:
            print(f"grail-serve: {exc}", file=sys.stderr, flush=True)
            return 2
    # The model names grail-train's model.train_id takes ('tiny': built offline, cached). Imported
    # here: the tiny model's builder (tokenizers, Qwen2) adds ~0.2 s to every other start.
    from grail.models.tiny import resolve_model

    model = resolve_model(args.model)
    model_dir = Path(model).resolve()
    name = args.served_model_name or (args.model if model != args.model else model_dir.name)
    try:
        engine = Engine(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            batch_invariant=args.batch_invariant,
            max_model_len=args.max_model_len,
            lora_dir=args.lora_dir,
            decode=args.decode,
            prefix_cache_mb=args.prefix_cache_mb,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        hint = " (--model takes an HF model directory or 'tiny')" if not model_dir.is_dir() else ""
        print(f"grail-serve: cannot load {model_dir}: {exc}{hint}", file=sys.stderr, flush=True)
        return 1
    limits = Limits.for_engine(
        engine.max_batch_size,
        engine.max_model_len,
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_request_tokens=args.max_request_tokens,
        max_queued_seqs=args.max_queued_seqs,
    )
    app = create_app(engine, name, key, limits)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    invariance = (
        f"batch-invariant (row quantum {engine.row_quantum})"
        if engine.batch_invariant
        else "not batch-invariant"
    )
    server = _ready_server(
        config,
        f"grail-serve ready: model '{name}' at {{url}} "
        f"({engine.device}, {str(engine.dtype).removeprefix('torch.')}, {invariance}, "
        f"max_model_len {engine.max_model_len})",
    )
    # Everything loaded so far (torch, transformers, the model) lives as long as the process: take
    # it out of the garbage collector's view. Otherwise every full collection walks its ~400k
    # objects, a ~200 ms pause of every request in flight, every few hundred requests.
    gc.collect()
    gc.freeze()
    with suppress(KeyboardInterrupt):  # SIGINT after the graceful shutdown already ran
        server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
