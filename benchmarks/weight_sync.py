"""Weight sync: in-place update of the built-in server against restarting it, on CPU.

    uv run python benchmarks/weight_sync.py                       # tiny + ~0.47B, float32
    uv run python benchmarks/weight_sync.py --models tiny --reps 5
    uv run python benchmarks/weight_sync.py --dtype bfloat16      # saved and served in bf16

What one step does, exactly as `grail-train` does after every optimizer step; a repetition is
three steps in a row: a restart, the first in-place update after it, and one more in-place update
(the steady state of a run: every iteration after the first), so each kind sees the same load
from other processes:

1. perturb every parameter of the benchmark's own copy of the model (untimed), so the update is
   real: p <- p + 0.05 * max(rms(p), 0.02) * N(0, 1), seeded per repetition (`perturb_`);
2. `save_pretrained(weights_dir)` (timed: "save");
3. `BuiltinServer.sync_weights(weights_dir, mode)` (timed: "sync"), mode "in_place"
   (POST /update_weights_from_disk: the server reads the safetensors and copies them into its
   live parameters) or "restart" (stop the process, start a new one on weights_dir, wait until
   /health answers);
4. verify (untimed) that the server now serves the new weights: the top-5 log-probabilities of a
   greedy one-token completion must match a forward pass of the perturbed model in this process
   (max |difference| <= tolerance) and be further than that from the weights before the sync,
   so a sync that silently kept the old weights fails (`compare_logprobs`).

Two more steps per repetition time the routes of grail/inference/weights/ in the steady
state: "in_place_served" writes the weights in the server's dtype (`--dtype`; the steps above
write the trainer's float32 master copy, as runs did before) and "shared" fills the trainer-side
buffers (timed as "save/fill") and hands the server their handles (POST
/update_weights_from_tensor, timed as "sync"): no file at all.

Printed per model: median seconds [min-max] of save and sync for each kind of step, and the
ratio in-place / restart of the sync medians (target on 2 CPU cores: <= 0.1; the first update
after a start is reported beside it, not in it: a run pays it once). For in-place the
server's own time (read + copy, from its log line "loaded N tensors ... in X s") is split out of
the sync time; the rest is HTTP and queueing. When the target is missed (or with --profile),
the in-place path is repeated in this process to split it into reading (`safe_open` +
`get_tensor`, lazy views of the file) and copying into the parameters (`profile_read_copy`).
Results: benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from common import print_table, spread, write_results

from grail.inference.weights.policy import PolicyWeights
from grail.inference.weights.shared import FlatWeights, tensor_payload

MODELS = ("tiny", "mid")
TARGET_RATIO = 0.1
# One repetition, in this order: a restart, the first in-place update after it (which also pays
# for the parameters still being copy-on-write views of the file the server loaded, see
# `profile_read_copy`), then an in-place update in the steady state of a run.
# Then the routes of grail/inference/weights/ in the steady state: the disk route writing the
# server's dtype (what a run does now; the steps above write the float32 master as it is, what
# runs did before), and the shared route (the trainer's buffers handed over, no file).
STEPS = ("restart", "in_place_first", "in_place", "in_place_served", "shared")
# How far the served log-probabilities may be from this process's forward pass: float32 differs
# only by kernel choice (batch-invariant row-wise attention on the server); bfloat16 rounds
# activations at every layer, differently on the two sides.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
TOP = 5
PROMPT_TEXT = "Repeat: 7"

_UPDATE_LINE = re.compile(
    r"loaded (?P<tensors>\d+) (?:shared )?tensors(?: from (?P<path>.+?))? "
    r"in (?P<seconds>[0-9.]+) s; "
    r"weight_version=(?P<version>\S+)"
)


def engine_update_seconds(log_text: str, version: str) -> float | None:
    """The server-side seconds of the in-place update labelled `version`, from its log.

    The built-in server logs `weights updated: loaded N tensors from DIR in X s;
    weight_version=V` once per update (engine read + copy, without HTTP). The last matching line
    wins; None when the log has none (another server version, or the update failed).
    """
    found = None
    for match in _UPDATE_LINE.finditer(log_text):
        if match.group("version") == version:
            found = float(match.group("seconds"))
    return found


def sync_ratio(in_place: Sequence[float], restart: Sequence[float]) -> float:
    """median(in-place seconds) / median(restart seconds)."""
    if not in_place or not restart:
        raise ValueError("both modes need at least one measurement")
    denominator = statistics.median(restart)
    if denominator <= 0:
        raise ValueError(f"restart median must be positive, got {denominator}")
    return statistics.median(in_place) / denominator


def compare_logprobs(
    served: dict[int, float], new: torch.Tensor, old: torch.Tensor, tol: float
) -> dict[str, Any]:
    """Whether the server serves the new weights: its top-k (token id -> logprob) against this
    process's log-softmax rows for the same prompt under the new weights (`new`) and the weights
    before the sync (`old`).

    off_new = max over the served tokens of |served - new|, off_old likewise against `old`.
    ok when off_new <= tol (the served numbers are the new weights') and off_old > off_new + tol
    (they are measurably not the old weights', so a sync that kept the old ones fails).
    """
    if not served:
        raise ValueError("the server returned no log-probabilities")
    off_new = max(abs(lp - float(new[token])) for token, lp in served.items())
    off_old = max(abs(lp - float(old[token])) for token, lp in served.items())
    return {
        "off_new": off_new,
        "off_old": off_old,
        "ok": off_new <= tol and off_old > off_new + tol,
    }


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.05, floor: float = 0.02) -> None:
    """p <- p + scale * max(rms(p), floor) * N(0, 1) for every parameter, in place.

    Relative to each tensor's own size, so norm weights (all 1 at init) and projections (std
    0.02) move alike; `floor` (the init std) moves tensors that are all zero (Qwen2's q/k/v
    biases at init) too. Deterministic in `seed`.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            rms = max(param.float().pow(2).mean().sqrt().item(), floor)
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_((noise * (scale * rms)).to(param.dtype))


# --------------------------------------------------------------------------------------------


def _served_top(root_url: str, prompt: list[int]) -> dict[int, float]:
    """Top-`TOP` log-probabilities of the next token, greedy, as {token id: logprob}."""
    body = {
        "model": "policy",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 0,
        "logprobs": TOP,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    response = httpx.post(f"{root_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(name.removeprefix("token_id:")): float(lp) for name, lp in top.items()}


def _as_served(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model in the server's dtype, as the server computes with it (a copy if converted)."""
    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)


def _local_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def _bytes_on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _source_dir(name: str, work: Path, dtype: torch.dtype) -> Path:
    from grail.models.tiny import MID_PRESET, TINY_PRESET, build_random_qwen2, ensure_tiny_model

    if name == "tiny" and dtype == torch.float32:
        return ensure_tiny_model()
    preset = TINY_PRESET if name == "tiny" else MID_PRESET
    t0 = time.perf_counter()
    path = build_random_qwen2(work / f"{name}-src", seed=0, dtype=dtype, **preset)
    print(f"built {name} in {time.perf_counter() - t0:.1f} s")
    return path


def bench_model(
    name: str,
    work: Path,
    reps: int,
    warmup: int,
    dtype_name: str,
    threads: int,
    scale: float,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grail.inference.backends.builtin import BuiltinServer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    tol = TOLERANCE[dtype_name]
    source = _source_dir(name, work, torch.float32)
    # The trainer's master copy is float32 whatever the server serves (`dtype`).
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    params = sum(p.numel() for p in model.parameters())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT_TEXT}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])

    # The directory the server serves and every sync rewrites, as grail-train's run_dir/weights.
    weights = work / f"{name}-weights"
    model.save_pretrained(weights)
    tokenizer.save_pretrained(weights)
    size = _bytes_on_disk(weights)
    print(f"{name}: {params / 1e6:.1f} M parameters, {size / 2**20:.0f} MiB of safetensors")

    times: dict[str, list[float]] = {f"{step}_s": [] for step in STEPS}
    times.update({f"{step}_save_s": [] for step in STEPS})
    checks: list[dict[str, Any]] = []
    server = BuiltinServer(
        weights,
        "policy",
        log_dir=work / "logs",
        threads=threads,
        dtype=dtype_name,
        start_timeout=900.0,
        weight_sync_timeout=900.0,
    )
    flat = FlatWeights(torch.device("cpu"))
    t0 = time.perf_counter()
    with server:
        print(f"{name}: server ready in {time.perf_counter() - t0:.1f} s")
        count = 0
        for rep in range(warmup + reps):
            timed = rep >= warmup
            for step in STEPS:
                mode = "restart" if step == "restart" else "in_place"
                count += 1
                old_row = _local_logprobs(_as_served(model, dtype), prompt_ids)
                perturb_(model, seed=1000 + count, scale=scale)
                version = f"{name}-{count}"
                t0 = time.perf_counter()
                if step == "shared":  # what SharedRoute does: fill the buffers, POST handles
                    flat.fill(PolicyWeights(model).named_tensors(), dtype)
                    save_s = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    server.update_weights_from_tensor(tensor_payload(flat, version))
                    sync_s = time.perf_counter() - t1
                else:
                    # the master copy (float32) as it is, or converted to the server's dtype
                    served_dtype = dtype if step == "in_place_served" else None
                    PolicyWeights(model).save(weights, served_dtype)
                    save_s = time.perf_counter() - t0
                    result = server.sync_weights(
                        weights, mode, fallback=False, weight_version=version
                    )
                    if result.mode_used != mode or result.fell_back:
                        raise RuntimeError(f"{mode} sync ran as {result.mode_used}")
                    sync_s = result.seconds
                served = _served_top(server.root_url, prompt_ids)
                new_row = _local_logprobs(_as_served(model, dtype), prompt_ids)
                check = compare_logprobs(served, new_row, old_row, tol)
                check.update(step=step, rep=rep, warmup=not timed)
                checks.append(check)
                if not check["ok"]:
                    raise RuntimeError(
                        f"{name} {step} sync: the server does not serve the new weights "
                        f"(max |served - new| = {check['off_new']:.2e}, tolerance {tol}; "
                        f"max |served - old| = {check['off_old']:.2e})"
                    )
                server_s = None
                if mode == "in_place":
                    server_s = engine_update_seconds(server.log_tail(400), version)
                line = f"{name} rep {rep}{' (warm-up)' if not timed else ''}: {step}"
                print(
                    f"{line}: save {save_s:.3f} s, sync {sync_s:.3f} s"
                    + (f" (server-side {server_s:.3f} s)" if server_s is not None else "")
                    + f"; served logprobs off new {check['off_new']:.1e}, off old "
                    f"{check['off_old']:.1e}"
                )
                if not timed:
                    continue
                times[f"{step}_save_s"].append(save_s)
                times[f"{step}_s"].append(sync_s)
                if server_s is not None:
                    times.setdefault(f"{step}_server_s", []).append(server_s)
    times["save_s"] = times["in_place_save_s"]
    ratio = sync_ratio(times["in_place_s"], times["restart_s"])
    save_median = statistics.median(times["save_s"])
    return {
        "parameters": params,
        "safetensors_bytes": size,
        "dtype": dtype_name,
        **{key: spread(values) for key, values in times.items() if values},
        "ratio_in_place_over_restart": ratio,
        "ratio_first_in_place_over_restart": sync_ratio(
            times["in_place_first_s"], times["restart_s"]
        ),
        "ratio_with_save": (save_median + statistics.median(times["in_place_s"]))
        / (save_median + statistics.median(times["restart_s"])),
        "in_place_gb_per_s": size / 1e9 / statistics.median(times["in_place_s"]),
        "target_ratio": TARGET_RATIO,
        "target_met": ratio <= TARGET_RATIO,
        "checks": checks,
    }


def profile_read_copy(weights: Path, model: torch.nn.Module, rounds: int = 3) -> dict[str, Any]:
    """Where the engine's in-place time goes, repeated in this process on a model loaded as the
    server loads it: `safe_open` + `get_tensor` for every tensor (as `Engine._read_checkpoint`,
    on the request thread) and `copy_` into the parameters (the engine's worker), `rounds` times.

    Round 1 is the first update after a start: `from_pretrained` leaves the parameters as
    copy-on-write views of the file it loaded, so the first copy also pays a page fault per page
    written. Later rounds are the steady state.
    """
    from safetensors import safe_open

    read, copy = [], []
    state = model.state_dict()
    for _ in range(rounds):
        t0 = time.perf_counter()
        tensors = {}
        with safe_open(weights / "model.safetensors", framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[key] = handle.get_tensor(key)
        read.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            for key, tensor in tensors.items():
                state[key].copy_(tensor)
        copy.append(time.perf_counter() - t0)
    return {"read_s": read, "copy_s": copy}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of tiny, mid")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions per mode first")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="server threads (default: half)")
    parser.add_argument(
        "--perturb", type=float, default=0.05, help="noise per sync, in units of rms(param)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile the in-place path even if on target"
    )
    parser.add_argument("--out", type=Path, default=None, help="results JSON path")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        parser.error(f"--models: unknown {unknown or names}; choose from {', '.join(MODELS)}")
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")

    import transformers

    from grail.core.placement import available_cores, split_cores

    transformers.utils.logging.disable_progress_bar()
    threads = args.threads or split_cores(available_cores(), pipelined=False)[1]
    torch.set_num_threads(threads)
    results: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="grail-weight-sync-"))
    try:
        for name in names:
            results[name] = bench_model(
                name, work, args.reps, args.warmup, args.dtype, threads, args.perturb
            )
            if args.profile or not results[name]["target_met"]:
                from transformers import AutoModelForCausalLM

                weights = work / f"{name}-weights"
                dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
                model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype)
                results[name]["profile"] = profile_read_copy(weights, model)
                del model
            shutil.rmtree(work / f"{name}-weights", ignore_errors=True)
            shutil.rmtree(work / f"{name}-src", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    labels = {
        "restart": "restart (float32 file)",
        "in_place_first": "disk float32, 1st after start",
        "in_place": "disk float32 (before)",
        "in_place_served": f"disk {args.dtype} (server's dtype)",
        "shared": "shared (no file)",
    }
    for name, r in results.items():
        for step in STEPS:
            stats = r[f"{step}_s"]
            save = r[f"{step}_save_s"]["median"]
            server_side = r.get(f"{step}_server_s", {}).get("median", "")
            ratio = r["ratio_in_place_over_restart"] if step == "in_place" else None
            if step == "in_place_first":
                ratio = r["ratio_first_in_place_over_restart"]
            rows.append(
                [
                    f"{name} {labels[step]}",
                    save,
                    stats["median"],
                    f"{stats['min']:.3g}-{stats['max']:.3g}",
                    server_side,
                    save + stats["median"],
                    f"{ratio:.4f}" if ratio is not None else "",
                ]
            )
    print_table(
        f"weight sync, server {args.dtype}, trainer float32, {threads} server thread(s), "
        f"median of {args.reps}",
        [
            "model, route", "save/fill s", "sync s", "sync min-max", "server-side s",
            "total s", "ratio to restart",
        ],
        rows,
    )  # fmt: skip
    failed = False
    for name, r in results.items():
        verdict = "met" if r["target_met"] else "NOT met"
        failed |= not r["target_met"]
        print(
            f"{name}: in-place/restart = {r['ratio_in_place_over_restart']:.4f} (target <= "
            f"{TARGET_RATIO}: {verdict}); first in-place after a start "
            f"{r['ratio_first_in_place_over_restart']:.4f}; with the save included "
            f"{r['ratio_with_save']:.3f}; in-place {r['in_place_gb_per_s']:.2f} GB/s"
        )
        if "profile" in r:
            p = r["profile"]
            print(
                "  in-place profile (this process): safetensors open + get_tensor "
                + ", ".join(f"{x:.3f}" for x in p["read_s"])
                + " s; copy into the parameters "
                + ", ".join(f"{x:.3f}" for x in p["copy_s"])
                + " s (first round: copy-on-write of the loaded file)"
            )
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_results("weight_sync", {"config": config, "models": results}, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
