"""What grail/tinker/wire.py costs per call on the RL shape of benchmarks/tinker_overhead.py:
reading the SDK's 1024-datum ``ForwardBackwardRequest`` (importance_sampling inputs, 64
copy_digits prompts x 16 completions of 2 tokens), writing the ``ForwardBackwardOutput`` of those
1024 datums, and writing the ``SampleResponse`` of one 16-sample request. No server, no model.

    uv run python benchmarks/tinker_wire.py              # 50 repeats of each, after 3 untimed
    uv run python benchmarks/tinker_wire.py --repeats 200

The body is what the pinned SDK itself serializes (`forward_backward_request_to_proto`), so it
is byte for byte what the server reads. Medians [min-max] in milliseconds; results go to
benchmarks/results/tinker_wire.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from client_overhead import default_prompts
from common import print_table, spread, write_results
from tinker_overhead import SHAPES, datums

from grail.models.tiny import ensure_tiny_model
from grail.tinker import wire


def sdk_body(data: list[wire.Datum]) -> bytes:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints(d.tokens),
                    loss_fn_inputs={k: t.values for k, t in d.inputs.items()},
                )
                for d in data
            ],
            loss_fn="importance_sampling",
        ),
        model_id="session:train:0",
        seq_id=1,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def timed_ms(call: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        call()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    prompts_n, n, max_tokens = SHAPES["rl"]
    data = datums(default_prompts(ensure_tiny_model(), prompts_n), n, max_tokens)
    body = sdk_body(data)
    rng = np.random.default_rng(0)
    outputs = [
        {name: rng.normal(size=len(d.tokens)) for name in ("logprobs", "elementwise_loss")}
        for d in data
    ]
    sequences = [wire.Sequence([5] * max_tokens, [-0.5] * max_tokens, True) for _ in range(n)]
    cases = {
        f"read ForwardBackwardRequest ({len(data)} datums, {len(body) / 1e6:.2f} MB)": lambda: (
            wire.read_forward_backward(body)
        ),
        f"write ForwardBackwardOutput ({len(data)} datums)": lambda: (
            wire.write_forward_backward_output(outputs, {"loss:sum": 1.0})
        ),
        f"write SampleResponse ({n} samples)": lambda: wire.write_sample_response(sequences, None),
    }
    results = {"repeats": args.repeats, "body_bytes": len(body), "cases": {}}
    rows = []
    for name, call in cases.items():
        s = spread(timed_ms(call, args.repeats))
        results["cases"][name] = s
        rows.append([name, f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"])
    print_table("grail/tinker/wire.py, ms per call", ["case", "median (min-max)"], rows)
    write_results("tinker_wire", results, args.out)


if __name__ == "__main__":
    main()
