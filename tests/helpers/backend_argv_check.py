"""Parse a server command line with the installed vLLM's or SGLang's own argument parser.

    python tests/helpers/backend_argv_check.py {vllm|sglang} < argv.json

argv.json is the list of arguments after `python -m MODULE` (for vLLM it starts with `serve`).
Prints one JSON object: the package version, the parser it used, and the parsed values of the
options the harness sets. Exits 2 with the parser's own message if the parser rejects the argv.
Run in a separate process because importing either package takes seconds and pulls in much.

vLLM: the same parser `vllm serve` builds (its `serve` subcommand on a FlexibleArgumentParser),
then its own post-parse validation and the mapping into engine arguments. On a machine without a
GPU vLLM cannot infer its platform; like `vllm bench`, we fall back to its CPU platform, which
only matters for defaults, not for what the parser accepts.
SGLang: `prepare_server_args`, what `sglang.launch_server` runs: `ServerArgs.add_cli_args` on a
plain ArgumentParser, a `--config` file's entries merged in (the harness passes the key that way),
then `ServerArgs.from_cli_args`, which runs its own checks.
"""

from __future__ import annotations

import json
import sys


def check_vllm(argv: list[str]) -> dict:
    import vllm
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # 0.11 .. 0.32
        from vllm.entrypoints.cli.serve import ServeSubcommand
    except ImportError as exc:  # pragma: no cover - depends on the installed version
        raise SystemExit(f"cannot find vLLM's serve subcommand: {exc}") from exc
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag  # what ServeSubcommand.cmd does
    ServeSubcommand().validate(args)
    engine = vllm.AsyncEngineArgs.from_cli_args(args)
    return {
        "version": vllm.__version__,
        "parser": "vllm.entrypoints.cli.serve.ServeSubcommand",
        "model": engine.model,
        "host": args.host,
        "port": args.port,
        "served_model_name": engine.served_model_name,
        "dtype": engine.dtype,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "seed": engine.seed,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "generation_config": engine.generation_config,
        "logprobs_mode": str(engine.logprobs_mode),
        "api_key": args.api_key,
    }


def check_sglang(argv: list[str]) -> dict:
    from sglang.srt.server_args import prepare_server_args
    from sglang.version import __version__

    server_args = prepare_server_args(argv)
    return {
        "version": __version__,
        "parser": "sglang.srt.server_args.prepare_server_args",
        "model": server_args.model_path,
        "host": server_args.host,
        "port": server_args.port,
        "served_model_name": server_args.served_model_name,
        "dtype": server_args.dtype,
        "mem_fraction_static": server_args.mem_fraction_static,
        "context_length": server_args.context_length,
        "max_running_requests": server_args.max_running_requests,
        "random_seed": server_args.random_seed,
        "tp_size": server_args.tp_size,
        "api_key": server_args.api_key,
    }


def main() -> None:
    backend = sys.argv[1]
    argv = json.loads(sys.stdin.read())
    result = check_vllm(argv) if backend == "vllm" else check_sglang(argv)
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
