"""A warm start for `env=lookup`: the tiny model taught the call format, not the task.

    uv run python examples/lookup_warm_start.py --out outputs/lookup-warm
    uv run grail-train env=lookup model.train_id=outputs/lookup-warm   # docs/episodes.md: settings

Why: the tiny random-init model never writes a `<tool_call>` by chance (the shortest call is 51
of its tokens, log p = -326 nats at initialisation; grail/envs/lookup.py), so GRPO has nothing to
reinforce. An instruct model arrives knowing its family's call format; this script gives the tiny
model that much and no more, by supervised steps on episodes written the way the policy's own
would be: the question with the tool described, a call of `lookup` with the asked key, the tool's
message, and an answer of **a random digit, drawn independently of the value** the tool returned.
The warm-started model therefore calls the tool and answers with one digit, but has no reason to
answer the digit the tool returned: its success is the 10% of a guess, what answering without the
tool can reach. What GRPO must add above 10% is the use of the tool's result (docs/episodes.md
has what the measured runs reached: not yet above a guess). `--answer value` answers with the
tool's value instead, teaching the use too, for a base that is to be given both.

Token-exact: each example is built by the same code that builds an episode's tokens in a run
(`ChatRenderer.render` for the prompt, `glue` and `suffix` for the tool's message, grail's
`ToolBox` for the tool's answer), so the supervised tokens are those the policy will sample and
the context is the context it will see. The loss is cross-entropy on the sampled tokens only (the
two assistant turns and their <|im_end|>), averaged per token.

Seeds: the warm start's episodes use problem seeds from `--first-seed` (2 * 10^6) on, which
neither training (data.train_seed_start 0, 10^5 seeds) nor evaluation (eval.id_seed_start 10^6)
draws from at the default sizes; its answers' digits come from their own generator. The run pins
the kernels a reproducible grail run pins (grail.core.reproducible); that the same arguments give
the same weights on other CPUs and thread counts has not been checked.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from grail.core.reproducible import pin_this_process

pin_this_process()  # before torch's first operation

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grail.envs.copy_digits import DIGITS  # noqa: E402
from grail.envs.lookup import LookupEnv  # noqa: E402
from grail.envs.tools import ToolBox  # noqa: E402
from grail.models.tiny import resolve_model, write_manifest  # noqa: E402
from grail.rollouts.chat import ChatRenderer  # noqa: E402

CALL = '<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'


def encode(renderer: ChatRenderer, text: str) -> list[int]:
    """The tokenizer's own ids for a turn's text (what a policy writing it most likely samples)."""
    return list(renderer.tokenizer(text, add_special_tokens=False)["input_ids"])


def example(
    env: LookupEnv, renderer: ChatRenderer, seed: int, answer: str | None
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of problem `seed`'s episode: a call with the asked key, then
    `answer`, whatever the tool returned (None: the episode's first turn alone)."""
    episode = env.reset(seed)
    toolbox = ToolBox(episode.tools)
    messages = list(episode.problem.prompt_messages)
    schemas = toolbox.schemas
    ids = renderer.render(messages, schemas, generation_prompt=True)
    mask = [0] * len(ids)
    end = renderer.closing[0]  # <|im_end|>: the policy samples it to end its turn

    call_text = CALL.format(key=episode.problem.meta["key"])
    call = encode(renderer, call_text) + [end]
    if answer is None:
        return ids + call, mask + [1] * len(call)
    answered = asyncio.run(toolbox.answer(call_text, deadline_s=10.0))
    assert answered is not None and answered.errors == 0, call_text
    messages.append({"role": "assistant", "content": call_text})
    context = renderer.glue(call) + renderer.suffix(messages, answered.messages, schemas)
    reply = encode(renderer, answer) + [end]
    ids += call + context + reply
    mask += [1] * len(call) + [0] * len(context) + [1] * len(reply)
    return ids, mask


def batches(
    examples: list[tuple[list[int], list[int]]], size: int, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded (input ids, attention mask, loss mask) batches, in order."""
    out = []
    for at in range(0, len(examples), size):
        chunk = examples[at : at + size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        loss = torch.zeros((len(chunk), width))
        for row, (tokens, mask) in enumerate(chunk):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            attention[row, : len(tokens)] = 1
            loss[row, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
        out.append((ids, attention, loss))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--base", default="tiny", help="the model to start from (default: tiny)")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=32, help="episodes per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak, decayed linearly to 0")
    parser.add_argument("--keys", type=int, default=4, help="LookupEnv's keys (conf/env/lookup)")
    parser.add_argument("--first-seed", type=int, default=2_000_000)
    parser.add_argument(
        "--answer",
        choices=("random", "value", "none"),
        default="random",
        help="the answer turn: a random digit (the format only), the tool's value (its use too), "
        "or none (the call alone, for a base whose own answers are to be kept)",
    )
    parser.add_argument("--seed", type=int, default=0, help="torch's and the answers' seed")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch must be at least 1")
    if args.out.exists():
        parser.error(f"--out {args.out} exists; name a new directory")

    torch.manual_seed(args.seed)
    base = resolve_model(args.base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer)
    env = LookupEnv(keys=args.keys)
    rng = random.Random(args.seed)
    seeds = range(args.first_seed, args.first_seed + args.steps * args.batch)
    examples = []
    for seed in seeds:
        digit = rng.choice(DIGITS)  # drawn whatever the answer: the same draws for each
        answer = digit if args.answer == "random" else None
        if args.answer == "value":
            answer = env.reset(seed).problem.answer
        examples.append(example(env, renderer, seed, answer))
    data = batches(examples, args.batch, tokenizer.pad_token_id)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # Linear decay to 0: the last steps refine the format at small steps, as SFT recipes do.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / len(data))
    model.train()
    started = time.perf_counter()
    for step, (ids, attention, loss_mask) in enumerate(data):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        target, mask = ids[:, 1:], loss_mask[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        )
        loss = (nll * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == len(data) - 1:
            took = time.perf_counter() - started
            print(f"step {step:4d}  loss {loss.item():.4f}  ({took:.0f} s)", flush=True)

    # Written whole into a temporary directory beside --out, then renamed: no half model.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        model.save_pretrained(tmp)
        for name in os.listdir(base):  # the base's tokenizer files, byte for byte
            if name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(Path(base) / name, tmp / name)
        write_manifest(
            tmp,
            {
                "warm_start": {
                    k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                }
            },
        )
        os.replace(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
