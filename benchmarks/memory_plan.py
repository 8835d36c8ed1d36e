"""The memory plan: what one trainer rank holds, per Qwen2.5 size and GPU count, computed (no GPU).

    uv run python benchmarks/memory_plan.py                        # the table of docs/scaling.md
    uv run python benchmarks/memory_plan.py --tokens 16384 --json  # one object per (size, GPUs)
    uv run python benchmarks/memory_plan.py --check                # against the measured peaks

One GPU is today's trainer (`train.processes=1`): float32 master weights under bf16 autocast, whose
weight cache holds a bf16 copy of every weight through the forward and backward passes. Several
GPUs are FSDP2 full sharding (`fully_shard` per decoder layer plus the root) with bf16 mixed
precision (param_dtype bf16, reduce_dtype float32): each rank keeps 1/N of the float32 state and
all-gathers a layer's bf16 weights when it runs it. Activations are not sharded: every rank runs
whole packed pieces of at most `train.micro_batch_tokens` tokens, one at a time (forward, then
backward), so its activations are those of one piece. Terms, in bytes (P parameters, N ranks):

    sharded state      params 4P/N + gradients 4P/N + AdamW exp_avg and exp_avg_sq 8P/N
    bf16 copies        1 GPU: 2P (autocast's weight cache);
                       N > 1: the root (embeddings, final norm, output layer) gathered through
                       the step, its bf16 parameters and gradient 2R + 2R, plus two decoder
                       layers in flight (the one computing, the one prefetched) 2 x 2 P_layer,
                       and one layer's bf16 gradient with its float32 reduce-scatter copy 6 P_layer
    activations        per token per layer, the tensors autograd saves (see `layer_activation`);
                       with gradient checkpointing each layer keeps only its input and one layer
                       is recomputed at a time: L x input + one layer
    output layer       the checkpointed head chunk, recomputed in backward: c = min(4096, T)
                       positions of bf16 logits and their bf16 gradient, 4cV, and the float32
                       temporaries of token_logprobs (logits, softmax, gradient) of one
                       512-row block, 12 x 512 V
    reference model    kl_coef > 0: 1 GPU loads it in float32 (4P); FSDP2 shards it, 4P/N; it runs
                       under no_grad before the update, so no activations of its own stay

Where the activation count comes from: Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (MLSys 2023, arXiv:2205.05198, section 4.1) count what autograd saves in
one GPT layer: 34 s b h + 5 a s^2 b bytes in 16-bit. The same counting, done for Qwen2's layer
(RMSNorm, grouped-query attention with a flash kernel, so no s^2 term, SwiGLU MLP of width I, no
dropout) gives per token:

    autocast over float32 weights (1 GPU; the residual stream is float32):
        norms: input + normalised output, float32, twice       16 h
        q, k, v inputs cast to bf16 one by one                  6 h
        attention: q, k, v in bf16 + output + o_proj input      2h + 4 kv + 4 h
        gate and up inputs cast to bf16                         4 h
        MLP: gate, SiLU(gate), up, their product (bf16)         8 I
        = 32 h + 4 kv + 8 I,  kv = kv_heads x head_dim
    bf16 parameters (FSDP2; the residual stream is bf16, RMSNorm upcasts its input):
        norms: float32 input + bf16 output, twice               12 h
        q/k/v input, q, attention output, o_proj input          8 h + 4 kv
        gate/up input                                           2 h
        MLP                                                     8 I
        = 22 h + 4 kv + 8 I   (plus 2 h for the layer's input kept by checkpointing)

and 8h per token after the last layer (final norm and the gathered hidden states). Checked
against the measured peaks (`--check`, docs/scaling.md): within 3% on one GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

GIB = 2**30
# token_logprobs' row block (grail/algo/logprobs.py DEFAULT_CHUNK_SIZE) and the output layer's
# checkpointed chunk (grail/train/packing.py DEFAULT_HEAD_CHUNK_TOKENS)
LOGPROB_ROWS = 512
HEAD_CHUNK_TOKENS = 4096
# What a rank needs beyond the tensors counted here: the CUDA context, cuBLAS/NCCL workspaces and
# the caching allocator's fragmentation. A plan "fits" when its total leaves this much free.
HEADROOM_GIB = 4.0


@dataclass(frozen=True)
class Shape:
    """A decoder's shape as its config.json gives it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One decoder layer: q, k, v (with biases, as Qwen2 has), o, the SwiGLU MLP, two norms."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        attention = (h * h + h) + 2 * (h * kv + kv) + h * h
        return attention + 3 * h * i + 2 * h

    def root_params(self) -> int:
        """What is outside the decoder layers: embeddings, the output layer unless tied, the
        final norm (FSDP2's root unit)."""
        embeddings = self.vocab * self.hidden
        return embeddings * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


# Qwen2.5's config.json (huggingface.co/Qwen/Qwen2.5-*/config.json)
QWEN25: dict[str, Shape] = {
    "0.5B": Shape(896, 24, 14, 2, 4864, 151_936, tied=True),
    "1.5B": Shape(1536, 28, 12, 2, 8960, 151_936, tied=True),
    "7B": Shape(3584, 28, 28, 4, 18944, 152_064, tied=False),
    "14B": Shape(5120, 48, 40, 8, 13824, 152_064, tied=False),
    "32B": Shape(5120, 64, 40, 8, 27648, 152_064, tied=False),
}


def layer_activation(shape: Shape, *, autocast: bool) -> int:
    """Bytes autograd saves per token in one decoder layer (module docstring): under autocast
    over float32 weights (one GPU) or with bf16 parameters (FSDP2)."""
    h, kv, i = shape.hidden, shape.kv_dim, shape.intermediate
    if autocast:
        return 32 * h + 4 * kv + 8 * i
    return 22 * h + 4 * kv + 8 * i


def activations(shape: Shape, tokens: int, *, autocast: bool, checkpointing: bool) -> int:
    """Bytes of one piece of `tokens` tokens' activations: every layer's (or, with gradient
    checkpointing, every layer's input and one layer's recomputed activations), and 8h per token
    after the last layer."""
    per_layer = layer_activation(shape, autocast=autocast)
    if checkpointing:
        kept = (4 if autocast else 2) * shape.hidden  # the layer's input, float32 or bf16
        per_token = shape.layers * kept + per_layer
    else:
        per_token = shape.layers * per_layer
    return tokens * (per_token + 8 * shape.hidden)


def head_logits(shape: Shape, tokens: int) -> int:
    """Bytes of the output layer's checkpointed chunk in backward (module docstring)."""
    chunk = min(HEAD_CHUNK_TOKENS, tokens)
    return 4 * chunk * shape.vocab + 12 * min(LOGPROB_ROWS, chunk) * shape.vocab


@dataclass(frozen=True)
class Plan:
    """One rank's memory in GiB, by term (module docstring)."""

    model: str
    gpus: int
    tokens: int
    params_b: float  # parameters, billions
    params: float
    grads: float
    adam: float
    bf16_copies: float
    activations: float
    activations_ckpt: float
    head_logits: float
    reference: float
    total: float  # without checkpointing, kl_coef = 0
    total_ckpt: float  # with gradient checkpointing, kl_coef = 0
    total_ckpt_ref: float  # with gradient checkpointing and the reference model (kl_coef > 0)


def plan(model: str, gpus: int, tokens: int, shape: Shape | None = None) -> Plan:
    """One rank's memory for `model` (a key of QWEN25, or `shape`) over `gpus` ranks at pieces
    of `tokens` tokens."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    s = shape or QWEN25[model]
    p = s.params()
    one = gpus == 1
    # one GPU: autocast's cache of every weight; FSDP2: the root gathered with its gradient,
    # two layers in flight and one layer's gradient on its way to the reduce-scatter
    in_flight = 4 * s.root_params() + 2 * 2 * s.layer_params() + 6 * s.layer_params()
    bf16 = 2 * p if one else in_flight
    act = activations(s, tokens, autocast=one, checkpointing=False)
    act_ckpt = activations(s, tokens, autocast=one, checkpointing=True)
    head = head_logits(s, tokens)
    ref = 4 * p / gpus
    state = 16 * p / gpus + bf16 + head
    return Plan(
        model=model,
        gpus=gpus,
        tokens=tokens,
        params_b=round(p / 1e9, 3),
        params=4 * p / gpus / GIB,
        grads=4 * p / gpus / GIB,
        adam=8 * p / gpus / GIB,
        bf16_copies=bf16 / GIB,
        activations=act / GIB,
        activations_ckpt=act_ckpt / GIB,
        head_logits=head / GIB,
        reference=ref / GIB,
        total=(state + act) / GIB,
        total_ckpt=(state + act_ckpt) / GIB,
        total_ckpt_ref=(state + act_ckpt + ref) / GIB,
    )


# Peaks measured on one H200 (docs/benchmarks.md, "The GRPO update's throughput and MFU":
# torch.cuda.max_memory_allocated of benchmarks/train_step_gpu.py, packed pieces, no checkpointing,
# kl_coef = 0): (model, tokens per piece, GiB)
MEASURED = [("0.5B", 4096, 17.4), ("0.5B", 16384, 37.2), ("1.5B", 16384, 82.2)]


def check() -> list[dict[str, float | str | int]]:
    """The model's one-GPU totals against MEASURED, with the relative error."""
    rows: list[dict[str, float | str | int]] = []
    for model, tokens, measured in MEASURED:
        predicted = plan(model, 1, tokens).total
        rows.append(
            {
                "model": model,
                "tokens": tokens,
                "measured_gib": measured,
                "predicted_gib": round(predicted, 2),
                "error": round((predicted - measured) / measured, 4),
            }
        )
    return rows


def fits(total_gib: float, gpu_gib: float) -> bool:
    return total_gib + HEADROOM_GIB <= gpu_gib


def table(plans: Sequence[Plan], gpu_gib: float) -> str:
    """The plain-text table docs/scaling.md shows."""
    head = (
        "| model | params | GPUs | params+grads+Adam | bf16 copies | activations | "
        "act. (ckpt) | head logits | reference | total | total (ckpt) | ckpt + ref |"
    )
    lines = [head, "|" + "---|" * 12]
    for p in plans:

        def mark(total: float) -> str:
            return f"{total:.1f}" + ("" if fits(total, gpu_gib) else " ✗")

        lines.append(
            f"| {p.model} | {p.params_b:.2f} B | {p.gpus} | {p.params + p.grads + p.adam:.1f} | "
            f"{p.bf16_copies:.1f} | {p.activations:.1f} | {p.activations_ckpt:.1f} | "
            f"{p.head_logits:.1f} | {p.reference:.1f} | {mark(p.total)} | "
            f"{mark(p.total_ckpt)} | {mark(p.total_ckpt_ref)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed piece")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--models", nargs="+", choices=list(QWEN25), default=list(QWEN25))
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    parser.add_argument("--check", action="store_true", help="compare with the measured peaks")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    if args.check:
        for row in check():
            print(json.dumps(row) if args.json else row)
        return 0
    plans = [plan(m, n, args.tokens) for m in args.models for n in args.gpus]
    if args.json:
        for p in plans:
            print(json.dumps({**asdict(p), "fits": fits(p.total, args.gpu_gib)}))
        return 0
    print(
        f"GiB per rank at {args.tokens}-token pieces, FSDP2 full sharding over N GPUs "
        f"(1 GPU: today's trainer); ✗: over {args.gpu_gib:g} GiB less {HEADROOM_GIB:g} GiB "
        "of headroom"
    )
    print(table(plans, args.gpu_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
