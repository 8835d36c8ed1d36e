"""Build a small random-initialised Qwen2 model and its tokenizer entirely offline.

Why: the default job, the smoke test and most of the test-suite need a real causal LM that
transformers, vLLM and SGLang all load, without any download. A Qwen2 architecture with a
byte-level BPE tokenizer is the most widely served shape, so the same directory goes through the
built-in server and through vLLM/SGLang unchanged.

Everything here is deterministic: the tokenizer depends only on `TOKENIZER_VERSION` (its
training corpus is generated from a fixed `random.Random`), the weights only on `seed`, and two
builds with the same arguments produce byte-identical files.

Public entry points:
- `build_tokenizer()`: the shared byte-level BPE tokenizer (a `PreTrainedTokenizerFast`).
- `build_random_qwen2(out_dir, hidden_size=..., num_layers=..., ..., seed=...)`: any size.
- `build_tiny_model(out_dir, seed, name)`: a preset of the tiny family (`TINY_PRESETS`: `tiny`,
  and `tiny-wide` at twice its width).
- `MID_PRESET`: a ~0.47B shape for `build_random_qwen2` (GPU tests, benchmarks).
- `ensure_tiny_model(cache_dir, seed, name)`: a preset, built once and cached, safe under
  concurrent callers, rebuilt when the cache is partial or corrupt.
- `resolve_model(model_id)`: what a model name means to `grail-train` (`model.train_id`) and
  `grail-serve --model`: `tiny` (or another preset's name) is this model; anything else is
  left for transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from grail.core.manifest import file_entry, file_problem
from grail.models import TINY_MODEL_NAME, TINY_MODEL_NAMES

# Bump when anything that changes the built files changes (sizes, corpus, template, init): the
# cache directory is named after it, so old caches are never mistaken for new ones.
BUILDER_VERSION = "4"  # 4: the chat template renders tools (weights as in 3)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)

# Qwen2.5-Instruct's chat template without its default system prompt: every message is
# `<|im_start|>{role}\n{content}<|im_end|>\n`; a generation prompt opens an assistant turn, and the
# model ends its turn with <|im_end|> (the eos token). With `tools=` it renders tools as Qwen2.5
# does (grail/envs/tools.py reads the calls back): a system turn holding the system message (if
# any) and a `# Tools` block of one JSON schema per line with the instruction to call them in
# <tool_call></tool_call> tags; an assistant message's `tool_calls` as such blocks; and a run of
# `tool` messages as one user turn of <tool_response> blocks. Without the default system prompt,
# the `# Tools` block opens the system turn when there is no system message (as Qwen3's template
# does); arguments given as a JSON string are written as is (as Qwen3's template does; Qwen2.5's
# would quote them again). Without tools, tool messages and tool_calls, it renders byte for byte
# what the template before tools did (tests/test_models.py checks).
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}
            {{- '\n' + message['content'] }}
        {%- endif %}
        {%- for tool_call in message['tool_calls'] %}
            {%- if tool_call['function'] is defined %}
                {%- set tool_call = tool_call['function'] %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call['name'] + '", "arguments": ' }}
            {%- if tool_call['arguments'] is string %}
                {{- tool_call['arguments'] }}
            {%- else %}
                {{- tool_call['arguments'] | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif not (tools and loop.first and message['role'] == 'system') %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""  # noqa: E501

# Qwen2's own pre-tokenisation. transformers 5 rebuilds a Qwen2 tokenizer's normalizer,
# pre-tokenizer and decoder from the model type (ignoring what tokenizer.json says), so we train
# with exactly that pipeline: then what `AutoTokenizer` loads is what we trained. Digits are
# split one per pre-token, so every digit is always its own token.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TOKENIZER_VOCAB_SIZE = 512

# Words the built-in tasks, chat template and answer formats use, so that they become single
# tokens (short prompts make generation and training cheap). Anything else still encodes through
# the 256 byte tokens, so no text is ever lost.
_CORPUS_WORDS: str = (
    # chat roles and common instructions
    "system user assistant You are a helpful assistant. Answer answer the question below "
    "Give your final answer Reply with only Respond Output Copy Repeat Write digit digits letter "
    "number numbers word words string "
    # solution tags and answer formats
    "<answer> </answer> <reasoning> </reasoning> <think> </think> <SOLUTION> </SOLUTION> "
    "<solution> </solution> #### ... Final final The is in following format Reason briefly "
    # SAT
    "Solve this SAT problem Boolean boolean satisfiability problems formula CNF clause clauses "
    "variable variables literal ~x1 ~x2 ~x3 ~x4 ~x5 ~x6 ~x7 ~x8 ~x9 x10 x11 x12 x13 x14 x15 x16 "
    "assignment assign satisfiable unsatisfiable satisfies UNSAT true false True False TRUE "
    "FALSE not NOT and AND or OR each every at least one of x1 x2 x3 x4 x5 x6 x7 x8 x9 "
    # GSM8K-style word problems
    "How many much does did do have has had each per total dollars cost costs buy buys bought "
    "sell sells sold pay paid more less than times half twice double triple day days week weeks "
    "month months year years hour hours minute minutes apples cookies books pages cars students "
    "friends money price she he they her his their them if what What was were are left after "
    "then of in on a an to for with by from into out that this it its there all some other "
    "gives gave get gets got makes made takes took spends spent earns earned saves saved "
    "remaining altogether together than people children box boxes bag bags cups miles"
)


def _tokenizer_corpus() -> list[str]:
    """A fixed training corpus: task words, numbers, punctuation and whitespace in many mixes.

    Generated from `random.Random(0)` with no dependence on the model seed, so every model built
    by this module shares one tokenizer.
    """
    rng = random.Random(0)
    words = _CORPUS_WORDS.split()
    punct = list(".,:;!?()[]{}<>=+-*/%$#'\"")
    lines: list[str] = []
    for _ in range(3000):
        parts: list[str] = []
        for _ in range(rng.randint(3, 14)):
            r = rng.random()
            if r < 0.65:
                parts.append(rng.choice(words))
            elif r < 0.85:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 4))))
            else:
                parts.append(rng.choice(punct))
        sep = rng.choice([" ", " ", " ", "\n", "  ", ", "])
        text = sep.join(parts) + rng.choice(["", ".", "\n", "\n\n"])
        # A third of the lines as chat turns (the template's "role\ncontent"), so role names
        # and the newline after them merge into few tokens, as they do in real chat tokenizers.
        if rng.random() < 0.33:
            text = rng.choice(["system", "user", "user", "assistant"]) + "\n" + text
        lines.append(text)
    # Every printable ASCII character on its own, so each has merges around it too.
    lines.append(string.printable)
    return lines


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the shared byte-level BPE tokenizer offline.

    The initial alphabet is all 256 byte symbols, so any UTF-8 text encodes and decodes
    losslessly; merges are learnt from `_tokenizer_corpus()`. <|endoftext|> is the pad token,
    <|im_end|> the eos token (a chat model ends its turn with it).
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size must be >= {min_size} (256 bytes + specials), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    # Name the class Qwen2 checkpoints ship with: transformers 4.x (which vLLM/SGLang may pin)
    # resolves it to Qwen2TokenizerFast reading our tokenizer.json; transformers 5 picks the
    # Qwen2 tokenizer from the model type anyway. "TokenizersBackend", what transformers 5
    # writes by default, does not exist in 4.x.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int)  # one token in, one id out
    return token_id


def build_random_qwen2(
    out_dir: Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    init_std: float = 0.02,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a random-initialised Qwen2ForCausalLM and its tokenizer to `out_dir`.

    Weights are drawn from N(0, init_std) (the transformers init for Linear and Embedding layers,
    norms at 1) under `torch.manual_seed(seed)` on CPU, so the safetensors bytes depend only on
    the arguments. `intermediate_size` defaults to 4 * hidden_size, `num_kv_heads` to num_heads.
    The tokenizer defaults to `build_tokenizer()`; the vocabulary size follows it.
    `generation_config.json` holds only eos/pad ids: servers read sampling defaults from it, and
    the harness, not the checkpoint, decides how to sample.
    """
    if hidden_size <= 0 or num_layers <= 0 or num_heads <= 0:
        raise ValueError(
            f"hidden_size, num_layers and num_heads must be positive, got "
            f"{hidden_size}, {num_layers}, {num_heads}"
        )
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if kv_heads <= 0 or num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {kv_heads}")
    if init_std <= 0:
        raise ValueError(f"init_std must be positive, got {init_std}")

    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    pad_id = _token_id(tokenizer, PAD_TOKEN)
    eos_id = _token_id(tokenizer, IM_END)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        use_sliding_window=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config.dtype = dtype
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)  # type: ignore[arg-type]  # transformers types .to's wrapper as taking the model
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    # transformers 5 writes only `rope_parameters`; 4.x (which vLLM/SGLang may pin) reads the
    # top-level `rope_theta` and would silently fall back to its default without it.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = rope_theta
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _save_tokenizer(tokenizer, out_dir)
    return out_dir


# The tiny preset. Chosen so that CPU generation and GRPO steps take milliseconds and the default
# learnable task is learnt from scratch within minutes on 2 cores (see grail/envs/<task>).
TINY_PRESET: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "init_std": 0.02,
    "tie_word_embeddings": True,
}


# The tiny family at twice the width: the same tokenizer, depth and head size (16), as a model
# family grows (Qwen2.5 keeps head_dim 128 from 0.5B to 72B): the narrow/wide pair a width
# fidelity study needs on CPU (docs/transfer.md).
TINY_WIDE_PRESET: dict[str, Any] = {
    **TINY_PRESET,
    "hidden_size": 128,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 512,
}

TINY_PRESETS: dict[str, dict[str, Any]] = {
    TINY_MODEL_NAME: TINY_PRESET,
    "tiny-wide": TINY_WIDE_PRESET,
}
assert set(TINY_PRESETS) == set(TINY_MODEL_NAMES)


# A Qwen2 shape with ~0.47B parameters at the tiny tokenizer's 512-token vocabulary (Qwen2.5-0.5B
# has 0.36B outside its 151,936-token embedding): 24 layers of attention 2*d^2 + 2*d*(d/4) and
# SwiGLU MLP 3*d*5504, d = 1024. Built with `build_random_qwen2(dir, **MID_PRESET)` wherever a
# realistic size matters offline: GPU tests, the weight-sync and training-step benchmarks.
MID_PRESET: dict[str, Any] = {
    "hidden_size": 1024,
    "num_layers": 24,
    "num_heads": 16,
    "num_kv_heads": 4,
    "intermediate_size": 5504,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def build_tiny_model(out_dir: Path, seed: int = 0, name: str = TINY_MODEL_NAME) -> Path:
    """Build the tiny family's preset `name` (`TINY_PRESETS`) into `out_dir`: the same bytes for
    a `seed` on every x86-64 CPU with AVX2.

    torch draws normal weights with AVX2 code only where it runs its AVX2 kernels; with AVX-512
    ones (or plain ones) it runs other code, and the weights differ in their last bits (measured:
    a different model.safetensors under ATEN_CPU_CAPABILITY=default), so every run on such a CPU
    would start from another model. On a CPU with AVX2 whose process runs other kernels (AVX-512
    ones, or plain ones under ATEN_CPU_CAPABILITY=default) the build therefore runs in a child
    process pinned to the AVX2 kernels (the variable is read at torch's first operation, so it
    cannot be changed in this one)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2" and torch.cpu._is_avx2_supported():
        return _build_in_avx2_child(Path(out_dir), seed, name)
    return build_random_qwen2(Path(out_dir), seed=seed, **TINY_PRESETS[name])


def _build_in_avx2_child(out_dir: Path, seed: int, name: str) -> Path:
    """`build_tiny_model` in a child process that runs torch's AVX2 kernels."""
    code = "import sys; from grail.models.tiny import build_tiny_model as b; b(sys.argv[1], int(sys.argv[2]), sys.argv[3])"  # noqa: E501
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    argv = [sys.executable, "-c", code, str(out_dir), str(seed), name]
    subprocess.run(argv, env=env, check=True)
    return out_dir


# ---------------------------------------------------------------------------------------------
# Cache: built once per (BUILDER_VERSION, seed), validated by a manifest written last.

MANIFEST_NAME = "grail_manifest.json"


def default_cache_dir() -> Path:
    """`$GRAIL_CACHE_DIR` if set, else `~/.cache/grail`."""
    env = os.environ.get("GRAIL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "grail"


def write_manifest(model_dir: Path, extra: dict[str, Any] | None = None) -> Path:
    """Record the size and sha256 of every file in `model_dir`; written last, so its presence
    marks a complete build. Written atomically (temp file + rename)."""
    files = {
        p.name: file_entry(p)
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"builder_version": BUILDER_VERSION, **(extra or {}), "files": files}
    tmp = model_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, model_dir / MANIFEST_NAME)
    return model_dir / MANIFEST_NAME


def manifest_problems(model_dir: Path) -> list[str]:
    """Why `model_dir` is not a complete, intact build; empty when it is.

    Checks the manifest exists and parses, the builder version matches, and every listed file
    exists with the recorded size and sha256 (a truncated or edited weights file fails here).
    """
    path = model_dir / MANIFEST_NAME
    if not path.is_file():
        return [f"missing {MANIFEST_NAME}"]
    try:
        manifest = json.loads(path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"unreadable {MANIFEST_NAME}: {exc}"]
    problems: list[str] = []
    if manifest.get("builder_version") != BUILDER_VERSION:
        problems.append(f"builder_version {manifest.get('builder_version')!r} != {BUILDER_VERSION}")
    if not files:
        problems.append("manifest lists no files")
    for name, info in files.items():
        if problem := file_problem(model_dir / name, info):
            problems.append(f"{name}: {problem}")
    return problems


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock) held for the block; released if the holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _is_complete(model_dir: Path, seed: int, name: str) -> bool:
    """An intact build of the current preset (a preset edited without a version bump rebuilds)."""
    if not model_dir.is_dir() or manifest_problems(model_dir):
        return False
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    return manifest.get("seed") == seed and manifest.get("preset") == TINY_PRESETS[name]


def tiny_model_cache_path(
    cache_dir: Path | None = None, seed: int = 0, name: str = TINY_MODEL_NAME
) -> Path:
    """Where `ensure_tiny_model` keeps preset `name` for `seed` (built or not yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{name}-qwen2-v{BUILDER_VERSION}-seed{seed}"


def ensure_tiny_model(
    cache_dir: Path | None = None, seed: int = 0, name: str = TINY_MODEL_NAME
) -> Path:
    """Return a directory holding the tiny model for `seed`, building it only when needed.

    The cache lives under `cache_dir` (default `$GRAIL_CACHE_DIR` or `~/.cache/grail`) in a
    directory named by `BUILDER_VERSION` and the seed. A build goes to a temporary sibling
    directory, gets its manifest last, and is renamed into place, so a crash never leaves a
    half-written model under the final name. A directory whose manifest is missing or does not
    match the files (partial copy, truncated weights) is rebuilt. Concurrent callers (processes
    or threads) serialise on a file lock: the first builds, the others find the finished build.
    """
    if name not in TINY_PRESETS:
        raise ValueError(f"no tiny preset {name!r}; known: {', '.join(TINY_PRESETS)}")
    target = tiny_model_cache_path(cache_dir, seed, name)
    if _is_complete(target, seed, name):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target, seed, name):
            return target  # another process built it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
        try:
            build_tiny_model(tmp, seed=seed, name=name)
            write_manifest(tmp, {"seed": seed, "preset": TINY_PRESETS[name]})
            if target.exists():
                # Move the broken build aside first: a rename over a non-empty directory fails.
                trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model_id: str) -> str:
    """'tiny' (or another preset's name, `TINY_PRESETS`) is the offline model (built once,
    cached); anything else (a local directory or a hub id) is returned as is, for
    transformers."""
    return str(ensure_tiny_model(name=model_id)) if model_id in TINY_PRESETS else model_id
