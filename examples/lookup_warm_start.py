"""A warm start for `env=lookup`: the tiny model taught the call format, and what else is asked.

    uv run python examples/lookup_warm_start.py --out outputs/lookup-warm
    uv run grail-train env=lookup model.train_id=outputs/lookup-warm   # docs/episodes.md: settings

Why: the tiny random-init model never writes a `<tool_call>` by chance (the shortest call is 51
of its tokens, log p = -326 nats at initialisation; grail/envs/lookup.py), so GRPO has nothing to
reinforce. An instruct model arrives knowing its family's call format; this script gives the tiny
model that by supervised steps on episodes written the way the policy's own would be: the
question with the tool described, a call of `lookup` with the asked key, the tool's message, and
an answer turn that is
- `--answer random` (default): a digit drawn independently of the value the tool returned: the
  format, not the task (success stays the 10% of a guess, what answering without the tool gets);
- `--answer value`: the tool's value: a demonstration of the whole task;
- `--answer none`: no answer turn (the call alone).
`--repeats N` adds N copy_digits episodes a step ("Repeat: 4821" answered "4821"), with the
tool's description before them under `--repeat-tools`: the copying of shown text an instruct
model also brings. `--batch 0 --repeats N` trains on repeats alone; `--stop-after K` ends after K
steps of the `--steps` schedule (a model part way through it). docs/episodes.md ("Tools") has what
each stage and GRPO from it measured.

Token-exact: each example is built by the same code that builds an episode's tokens in a run
(`ChatRenderer.render` for the prompt, `glue` and `suffix` for the tool's message, grail's
`ToolBox` for the tool's answer), so the supervised tokens are those the policy will sample and
the context is the context it will see. The loss is cross-entropy on the sampled tokens only (the
assistant turns and their <|im_end|>), averaged per token within the lookup episodes and within
the repeats, then over the two. Each step runs the lookup episodes' common prefix (the tools'
description, ~430 of ~570 tokens) once for all of them: ~0.2 s a step instead of ~0.85 s on the
2-core CI machine, with the same loss and gradients (tests/test_lookup.py).

Seeds: the warm start's episodes use problem seeds from `--first-seed` (2 * 10^6) on, which
neither training (data.train_seed_start 0, 10^5 seeds) nor evaluation (eval.id_seed_start 10^6)
draws from at the default sizes (the repeats are copy_digits problems of the same seeds); its
random answers' digits come from their own generator. The run pins
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
from typing import Any

from grail.core.reproducible import pin_this_process

pin_this_process()  # before torch's first operation

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grail.envs.copy_digits import DIGITS, CopyDigitsEnv  # noqa: E402
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


def repeat_example(
    renderer: ChatRenderer, seed: int, digits: int, tools: list[dict[str, Any]] | None
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of copy_digits' problem `seed` with `digits` digits ("Repeat:
    4821" answered "4821"), with `tools` offered or none: copying text a user turn showed, which
    a tool's result also is (the chat template renders it as a user turn)."""
    problem = CopyDigitsEnv(digits).problem(seed)
    ids = renderer.render(list(problem.prompt_messages), tools, generation_prompt=True)
    reply = encode(renderer, problem.answer) + [renderer.closing[0]]
    return ids + reply, [0] * len(ids) + [1] * len(reply)


def batch(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input ids, attention mask, loss mask) of the examples."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss = torch.zeros((len(examples), width))
    for row, (tokens, mask) in enumerate(examples):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        loss[row, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return ids, attention, loss


def shared_prefix(ids: torch.Tensor, attention: torch.Tensor) -> int:
    """How many leading tokens every row of the batch has in common (all attended)."""
    same = (ids == ids[:1]).all(dim=0) & (attention == 1).all(dim=0)
    return len(ids[0]) if bool(same.all()) else int(same.int().argmin())


def nll_sum(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, count) of the sampled tokens of one batch, the rows' common prefix
    run once for the whole batch.

    Why the prefix: every lookup example opens with the same system turn (the tool's
    description, ~430 of an episode's ~570 tokens), so running it once and handing its keys and
    values to every row (gradients flow through them) makes a step ~4x cheaper on CPU; the loss
    is the full forward's (tests/test_lookup.py compares them). No loss falls in the prefix.
    """
    shared = min(shared_prefix(ids, attention), ids.shape[1] - 1)
    if shared > 0 and not bool(loss_mask[:, 1 : shared + 1].any()):
        cache = model(input_ids=ids[:1, :shared], use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(ids))
        logits = model(
            input_ids=ids[:, shared:], attention_mask=attention, past_key_values=cache
        ).logits
        start = shared
    else:
        logits, start = model(input_ids=ids, attention_mask=attention).logits, 0
    # logits[:, i] predicts token start + i + 1
    logits = logits[:, :-1]
    target, mask = ids[:, start + 1 :], loss_mask[:, start + 1 :]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
    )
    return (nll * mask.reshape(-1)).sum(), mask.sum()


def sft_loss(
    model: torch.nn.Module, *batches: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Cross-entropy per sampled token, averaged within each batch, then over the batches: the
    repeats' few tokens weigh as much as the lookup episodes' many (a mean over all tokens
    together left them 2-4% of the loss, and 3,000 steps did not teach the copying)."""
    means = [total / count for total, count in (nll_sum(model, *one) for one in batches)]
    return torch.stack(means).mean()


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
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="copy_digits episodes a step (1-3 digits, answered) beside the lookup episodes: "
        "the copying of shown text an instruct model arrives with",
    )
    parser.add_argument(
        "--repeat-tools",
        action="store_true",
        help="offer the lookup tool in the repeats too (its ~430-token description before them)",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        help="stop after this many of the --steps schedule's steps (a model part way through it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="torch's and the answers' seed")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 0 or args.repeats < 0 or args.batch + args.repeats < 1:
        parser.error("--steps must be at least 1, --batch + --repeats at least 1 (each >= 0)")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        parser.error(f"--stop-after must be in 1..--steps ({args.steps}), got {args.stop_after}")
    if args.out.exists():
        parser.error(f"--out {args.out} exists; name a new directory")

    torch.manual_seed(args.seed)
    base = resolve_model(args.base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer)
    env = LookupEnv(keys=args.keys)
    rng = random.Random(args.seed)
    tools = ToolBox(env.reset(args.first_seed).tools).schemas if args.repeat_tools else None

    def step_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Step `step`'s lookup episodes and repeats, built when needed (96,000 examples held
        at once took ~2 GB), as two batches: only the first share the tools' description."""
        first = args.first_seed + step * args.batch
        examples = []
        for seed in range(first, first + args.batch):
            digit = rng.choice(DIGITS)  # drawn whatever the answer: the same draws for each
            answer = digit if args.answer == "random" else None
            if args.answer == "value":
                answer = env.reset(seed).problem.answer
            examples.append(example(env, renderer, seed, answer))
        first_repeat = args.first_seed + step * args.repeats  # copy_digits' seeds: its own
        repeats = [
            repeat_example(renderer, seed, rng.randint(1, 3), tools)
            for seed in range(first_repeat, first_repeat + args.repeats)
        ]
        return [batch(part, tokenizer.pad_token_id) for part in (examples, repeats) if part]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # Linear decay to 0: the last steps refine the format at small steps, as SFT recipes do.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / args.steps)
    model.train()
    started = time.perf_counter()
    last = args.steps if args.stop_after is None else args.stop_after
    for step in range(last):
        loss = sft_loss(model, *step_batches(step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == last - 1:
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
