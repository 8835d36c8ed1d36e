"""``grail-tinker``: grail as a Tinker service the official ``tinker`` SDK drives (docs/tinker.md).

    export TINKER_API_KEY="tml-$(python -c 'import secrets; print(secrets.token_hex(16))')"
    uv run grail-tinker --model tiny --port 8000

then, in the client (which reads the same ``TINKER_API_KEY``):
``tinker.ServiceClient(base_url="http://127.0.0.1:8000")`` and
``create_lora_training_client(base_model="tiny")``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from grail.core.choices import BACKENDS
from grail.core.errors import UserError
from grail.core.reproducible import (
    REPRODUCIBLE_THREADS,
    apply_reproducible_env,
    check_torch_honours,
)

if TYPE_CHECKING:
    from grail.tinker.sampler import SampleEngine

log = logging.getLogger("grail.tinker")

DEFAULT_MAX_REQUEST_BYTES = 256 * 2**20
KEY_PREFIX = "tml-"  # the SDK sends no key without it
# Characters after the prefix: 16 random hex digits are 64 bits, beyond guessing over HTTP; a
# shorter key is a placeholder (``tml-``, ``tml-local``), not a secret.
MIN_KEY_CHARS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="grail-tinker",
        description="Serve a model for training (LoRA) and sampling over the Tinker REST protocol.",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="an offline tiny model (tiny, or tiny-wide at twice its width), a local model "
        "directory or a hub id",
    )
    p.add_argument(
        "--name",
        default=None,
        help="the model name clients pass as base_model (default: --model as given)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("TINKER_API_KEY"),
        help=f"the key clients send: '{KEY_PREFIX}' (the SDK requires it) and at least "
        f"{MIN_KEY_CHARS} more characters; default $TINKER_API_KEY",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="metrics and checkpoints (default: outputs/tinker/<date>_<time>)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (trainer and sampler)")
    p.add_argument(
        "--sampler",
        default="engine",
        choices=("engine", *BACKENDS),  # a sampler server: grail-train's backends
        help="engine: the built-in engine in this process; builtin, vllm or sglang: that server "
        "in its own process, given each snapshot's weights through a weight route",
    )
    p.add_argument(
        "--sampler-device",
        default=None,
        help="the sampler server's device (default: --device); not for --sampler engine",
    )
    p.add_argument(
        "--weight-transfer",
        default="auto",
        choices=("auto", "disk", "shared", "nccl"),
        help="how a sampler server gets a snapshot's weights (auto: as grail-train picks)",
    )
    p.add_argument(
        "--sampler-args",
        default="",
        help="extra command-line arguments for the sampler server, one string (shell quoting)",
    )
    p.add_argument(
        "--sampler-start-timeout",
        type=float,
        default=None,
        help="seconds the sampler server may take to start (default: the backend's)",
    )
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument(
        "--max-training-clients",
        type=int,
        default=8,
        help="training clients (LoRA adapters) held at once; more are refused",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=256,
        help="requests queued or running at once; past it the SDK backs off (429)",
    )
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 under --reproducible, as grail-train's "
        "reproducible=true; torch's choice otherwise)",
    )
    p.add_argument(
        "--reproducible",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch's AVX2 CPU kernels and MKL's COMPATIBLE branch, as grail-train's "
        "reproducible=true pins them: the same numbers on any x86-64 CPU with AVX2 "
        "of one vendor (grail/core/reproducible.py); --no-reproducible lets the machine's "
        "kernels decide",
    )
    p.add_argument("--log-level", default="warning")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        serve(args)
    except UserError as exc:
        print(f"grail-tinker: {exc}", file=sys.stderr)
        sys.exit(2)


class TinkerArgsError(UserError, ValueError):
    pass


GENERATE_KEY = "tml-$(python -c 'import secrets; print(secrets.token_hex(16))')"


def check_args(args: argparse.Namespace) -> None:
    """Refuse a key the SDK cannot send or anyone could guess; warn when the server is reachable
    from other machines."""
    key = args.api_key
    if not key:
        raise TinkerArgsError(
            f'give --api-key (or set TINKER_API_KEY), e.g. --api-key "{GENERATE_KEY}"'
        )
    if not key.startswith(KEY_PREFIX):
        raise TinkerArgsError(
            f"--api-key {key[:4]}...: the tinker SDK only sends keys that start with "
            f"'{KEY_PREFIX}'; choose one that does"
        )
    if len(key) - len(KEY_PREFIX) < MIN_KEY_CHARS:
        raise TinkerArgsError(
            f"--api-key: {len(key) - len(KEY_PREFIX)} characters after '{KEY_PREFIX}', too short "
            f'to be secret; give at least {MIN_KEY_CHARS}, e.g. --api-key "{GENERATE_KEY}"'
        )
    if not is_loopback(args.host):
        log.warning(
            "--host %s: grail-tinker is reachable from other machines; anyone who can reach "
            "port %d with the API key can train and sample (--host 127.0.0.1 keeps it local)",
            args.host, args.port,
        )  # fmt: skip


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches: 127.0.0.0/8, ::1, ``localhost``. A name
    is not resolved here (it could be any interface): only ``localhost`` counts."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> None:
    check_args(args)
    if args.reproducible:  # before torch's first operation, when torch and MKL read them; a
        # sampler server started below inherits them
        apply_reproducible_env(os.environ)
        if args.threads is None:
            args.threads = REPRODUCIBLE_THREADS
    # Heavy imports after the argument checks, so that --help and bad flags answer at once.
    import torch
    import uvicorn

    from grail.core.records import run_lock
    from grail.models.loading import load_model
    from grail.tinker.app import create_app
    from grail.tinker.checkpoints import Checkpoints
    from grail.tinker.core import ModelInfo, TinkerCore
    from grail.tinker.sampler import Sampler
    from grail.tinker.trainer import Trainer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # check_torch_honours raises a ConfigError (a UserError: one line from main) for other kernels
    kernels = (
        check_torch_honours() if args.reproducible else torch.backends.cpu.get_cpu_capability()
    )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise TinkerArgsError(f"--device {args.device}: CUDA is not available on this machine")
    model_dir = _model_dir(args.model)
    name = args.name or args.model
    run_dir = args.run_dir or Path("outputs/tinker") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    run_dir = run_dir.resolve()
    start = time.perf_counter()
    model = load_model(model_dir, dtype=args.dtype, device=args.device)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    with run_lock(run_dir):
        engine = sampler_engine(args, model_dir, run_dir, context)
        try:
            info = ModelInfo(
                name=name,
                arch=str(getattr(model.config, "model_type", "unknown")),
                tokenizer_id=str(model_dir),
                max_context=context,
            )
            checkpoints = Checkpoints(run_dir)
            trainer = Trainer(
                model, base_model=name, run_dir=run_dir, max_context=context,
                max_clients=args.max_training_clients,
            )  # fmt: skip
            sampler = Sampler(engine, name, checkpoints.resolve)
            core = TinkerCore(trainer, sampler, checkpoints, info, max_pending=args.max_pending)
            app = create_app(core, args.api_key, args.max_request_bytes)
            config = uvicorn.Config(
                app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5,
            )  # fmt: skip
            print(
                f"grail-tinker: serving {name!r} ({model_dir}) on http://{args.host}:{args.port}, "
                f"run dir {run_dir}, sampler {args.sampler}, CPU kernels {kernels}"
                f"{' (pinned: --reproducible)' if args.reproducible else ''} "
                f"(loaded in {time.perf_counter() - start:.1f} s)",
                flush=True,
            )
            uvicorn.Server(config).run()
        finally:
            engine.stop()


def sampler_engine(
    args: argparse.Namespace, model_dir: Path, run_dir: Path, context: int
) -> SampleEngine:
    """The engine the sampler feeds: the built-in engine here, or a started sampler server."""
    from grail.inference.errors import ServerError
    from grail.models.loading import load_model
    from grail.tinker.sampler import engine_for
    from grail.tinker.server_sampler import start_server_engine

    if args.sampler == "engine":
        if args.sampler_device is not None:
            raise TinkerArgsError("--sampler-device is for a sampler server (--sampler builtin)")
        return engine_for(model_dir, args.device, context, args.dtype)
    try:
        return start_server_engine(
            args.sampler,
            model_dir,
            run_dir / "sampler" / "model",
            load=lambda: load_model(model_dir, dtype=args.dtype, device=args.device),
            trainer_device=args.device,
            server_device=args.sampler_device or args.device,
            dtype=args.dtype,
            weight_transfer=args.weight_transfer,
            threads=args.threads,
            extra_args=shlex.split(args.sampler_args),
            start_timeout=args.sampler_start_timeout,
        )
    except (ServerError, ValueError) as exc:
        raise TinkerArgsError(f"--sampler {args.sampler}: {exc}") from exc


def _model_dir(model: str) -> Path:
    """A local directory holding the model: a tiny preset's cache (`TINY_PRESETS`, as
    grail-train's model.train_id names them), the directory given, or a hub id's snapshot
    (downloaded once; the engine and the SDK's tokenizer read it locally)."""
    from grail.models.loading import check_model_source, is_hub_id
    from grail.models.tiny import TINY_PRESETS, ensure_tiny_model

    if model in TINY_PRESETS:
        return ensure_tiny_model(name=model)
    path = Path(model).expanduser()
    if path.exists() or not is_hub_id(model):
        check_model_source(path)
        return path.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model))
    except Exception as exc:
        raise TinkerArgsError(f"--model {model}: could not fetch it from the hub ({exc})") from exc


if __name__ == "__main__":
    main()
