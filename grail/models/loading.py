"""Load causal LMs and tokenizers by local directory or Hugging Face Hub id.

Why a wrapper around the Auto classes: these failure modes deserve clear messages instead of a
long transformers traceback: a mistyped local path (FileNotFoundError naming it), a local
directory that lacks files (`model_dir_problems`: transformers loads a directory without tokenizer
files as an empty tokenizer that encodes every text to nothing, misreads a missing config.json as
"unrecognized model", and names no file for truncated weights), a hub id on a machine without hub
access (an error that says so and suggests a local copy), and a tokenizer without a pad token
(batched generation and training need one; we fall back to eos, as most causal LMs expect).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grail.core.errors import UserError

# "org/name" with the characters the hub allows (a revision is not part of the id).
# Checked with fullmatch: `$` in a match() also matches before a final newline.
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Fragments of the errors huggingface_hub/transformers raise when the hub cannot be reached or
# offline mode forbids it (as opposed to "no such repository" or "no such file").
_UNREACHABLE_HINTS = (
    "offline",
    "couldn't connect",
    "could not connect",
    "connection",
    "cannot find the requested files in the disk cache",
    "cannot find the requested files in the local cache",
    "outgoing traffic has been disabled",
    "name resolution",
    "timed out",
)


# What a `save_pretrained` directory needs, by role. Weights: one file, or an index naming shards.
CONFIG_FILE = "config.json"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# A tokenizer loads from any one of these vocabularies (fast tokenizers, SentencePiece, byte-level
# BPE and WordPiece, tiktoken); tokenizer_config.json alone is not a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
)


def is_hub_id(name: str) -> bool:
    """True when `name` has the shape of a hub repository id, `org/name`."""
    return _HUB_ID_RE.fullmatch(name) is not None


def resolve_source(name_or_path: str | Path) -> str:
    """A local directory (as a string) or a hub id; anything else is a FileNotFoundError.

    A path that exists wins over a hub id of the same spelling, as in transformers.
    """
    text = str(name_or_path)
    if not text.strip():
        raise ValueError("model name_or_path is empty")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(
                f"model path {text!r} is a file; expected a save_pretrained directory"
            )
        return str(path)
    if isinstance(name_or_path, str) and is_hub_id(text):
        return text
    raise FileNotFoundError(
        f"model path {text!r} does not exist (resolved to {path.resolve()}) and is not a "
        "Hugging Face Hub id of the form 'org/name'"
    )


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face Hub's endpoint answers an HTTP request within `timeout` seconds
    (any answer: a TCP connection alone proves nothing behind a proxy that accepts them all)."""
    import threading

    import httpx
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    answered: list[bool] = []

    def ask() -> None:
        try:
            httpx.head(constants.ENDPOINT, timeout=timeout)
            answered.append(True)
        except httpx.HTTPError:
            pass

    # In a thread joined with the timeout: name lookup is not bounded by httpx's timeouts.
    thread = threading.Thread(target=ask, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def check_hub_source(source: str) -> None:
    """For a hub id not in the local hub cache: fail now, in one line, when the hub cannot be
    reached. transformers found that out only after about a minute of retries per file."""
    from huggingface_hub import try_to_load_from_cache

    if not is_hub_id(source) or Path(source).exists():
        return
    if isinstance(try_to_load_from_cache(source, "config.json"), str):
        return  # cached: transformers loads it without the hub
    if not hub_reachable():
        raise OSError(
            f"{source!r} is not in the local Hugging Face Hub cache and the hub is unreachable "
            "(or offline mode is set, HF_HUB_OFFLINE=1): download it where the hub is reachable "
            f"(e.g. `hf download {source} --local-dir DIR`) and pass the local directory DIR "
            "instead"
        )


def _safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file at `path` is cut short, from its header alone (the 8-byte header
    length, the JSON header, then the tensors' byte ranges); None when its size is what the header
    promises."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(header_len))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{path}: not a readable safetensors file ({size} bytes; {exc}); truncated?"
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"{path}: truncated ({size} bytes, its header needs {expected})"
    return None


def model_dir_problems(directory: Path, *, tokenizer: bool = True) -> list[str]:
    """What keeps the `save_pretrained` directory `directory` from loading, each naming the files
    (empty when nothing does): config.json, weights (safetensors checked against their headers,
    so a truncated file is named) and, with `tokenizer`, a tokenizer vocabulary."""
    directory = Path(directory)
    problems = []
    if not (directory / CONFIG_FILE).is_file():
        problems.append(f"{directory} has no {CONFIG_FILE}")
    weights = [directory / name for name in WEIGHT_FILES if (directory / name).is_file()]
    if not weights:
        problems.append(f"{directory} has no weights (none of {', '.join(WEIGHT_FILES)})")
    safetensors = [p for p in weights if p.name == "model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if index in weights:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            problems.append(f"{index}: unreadable ({exc})")
            shards = set()
        for shard in sorted(shards):
            if (directory / shard).is_file():
                safetensors.append(directory / shard)
            else:
                problems.append(f"{directory / shard} is missing (listed in {index.name})")
    problems += [p for p in map(_safetensors_problem, safetensors) if p is not None]
    if tokenizer and (problem := _tokenizer_problem(directory)):
        problems.append(problem)
    return problems


def _tokenizer_problem(directory: Path) -> str | None:
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    if any(directory.glob("*.tiktoken")):
        return None
    return (
        f"{directory} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)} is needed): "
        "copy the model's tokenizer files into it (from where the weights came from)"
    )


class ModelFilesError(UserError, FileNotFoundError):
    """A local model directory lacks files or holds a damaged one; the message names them."""


def _raise_problems(directory: Path, problems: list[str]) -> None:
    if problems:
        raise ModelFilesError(
            f"model directory {directory} cannot be loaded:\n  " + "\n  ".join(problems)
        )


def check_model_source(name_or_path: str | Path, *, tokenizer: bool = True) -> None:
    """Fail now, naming the missing or damaged files, when `name_or_path` is a local directory
    that cannot load (a hub id is checked when it downloads)."""
    source = resolve_source(name_or_path)
    if Path(source).is_dir():
        _raise_problems(Path(source), model_dir_problems(Path(source), tokenizer=tokenizer))


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.dtype from a dtype or a name ("float32", "bf16", "torch.float16", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(set(_DTYPES))}")


def _hub_error(source: str, what: str, exc: Exception) -> Exception:
    """Re-word a failed hub load: say whether the hub was unreachable, suggest a local path."""
    message = str(exc)
    lowered = message.lower()
    advice = (
        f"download it where the hub is reachable (e.g. `hf download {source} --local-dir "
        f"DIR`) and pass the local directory DIR instead"
    )
    if any(hint in lowered for hint in _UNREACHABLE_HINTS):
        return OSError(
            f"could not load {what} {source!r}: the Hugging Face Hub is unreachable (or offline "
            f"mode is set, HF_HUB_OFFLINE=1) and it is not in the local hub cache; {advice}. "
            f"Original error: {message}"
        )
    return OSError(f"could not load {what} {source!r} from the Hugging Face Hub: {message}")


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer with `AutoTokenizer`; pad_token falls back to eos_token when unset.

    Padding side is left as loaded: left padding for generation and right padding for training
    are the caller's choice.
    """
    source = resolve_source(name_or_path)
    if Path(source).is_dir():
        problem = _tokenizer_problem(Path(source))
        _raise_problems(Path(source), [problem] if problem else [])
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        if Path(source).exists():
            raise
        raise _hub_error(source, "tokenizer", exc) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {source!r} has neither a pad token nor an eos token to use as one"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str | Path,
    dtype: torch.dtype | str = "float32",
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM` in `dtype`, moved to `device`."""
    torch_dtype = parse_dtype(dtype)
    source = resolve_source(name_or_path)
    local = Path(source).is_dir()
    if local:
        _raise_problems(Path(source), model_dir_problems(Path(source), tokenizer=False))
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except Exception as exc:
        if local:  # e.g. safetensors' "incomplete metadata", which names no file
            raise OSError(f"could not load the model in {source}: {exc}") from exc
        if isinstance(exc, OSError):
            raise _hub_error(source, "model", exc) from exc
        raise
    return model.to(torch.device(device))  # type: ignore[arg-type]  # transformers types .to's wrapper as taking the model
