"""The tiny offline model: deterministic build, transformers round-trips, cache, loading errors
(missing and truncated files named before transformers sees them)."""

from __future__ import annotations

import hashlib
import json
import socket
import string
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from grail.envs import make_env
from grail.envs.gsm8k import SYSTEM_PROMPT as GSM8K_SYSTEM_PROMPT
from grail.envs.sat import SYSTEM_PROMPT as SAT_SYSTEM_PROMPT
from grail.models import tiny
from grail.models.loading import (
    load_model,
    load_tokenizer,
    model_dir_problems,
    parse_dtype,
    resolve_source,
)
from grail.rollouts.generation import render_prompt_ids

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _hashes(model_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode for the hub libraries, and any TCP connection attempt fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"network access attempted: {address!r}")
        return real_connect(self, address)

    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)


# ---------------------------------------------------------------------------------------------
# Build


def test_build_is_offline_deterministic_and_seeded(tmp_path: Path, no_network: None) -> None:
    a = tiny.build_tiny_model(tmp_path / "a", seed=0)
    b = tiny.build_tiny_model(tmp_path / "b", seed=0)
    c = tiny.build_tiny_model(tmp_path / "c", seed=1)
    ha, hb, hc = _hashes(a), _hashes(b), _hashes(c)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
        ha
    )
    assert ha == hb, "same seed must give byte-identical files"
    assert ha["model.safetensors"] != hc["model.safetensors"], "the seed must change the weights"
    # The tokenizer is shared by every seed (only the weights depend on it).
    assert ha["tokenizer.json"] == hc["tokenizer.json"]


@pytest.mark.learning
@pytest.mark.skipif(not torch.cpu._is_avx2_supported(), reason="needs a CPU with AVX2")
def test_the_avx2_child_builds_the_same_weights(tmp_path: Path) -> None:
    # What a CPU whose process runs other kernels builds (in a child pinned to the AVX2 kernels)
    # against what this process builds under the AVX2 kernels the test session pins
    # (tests/conftest.py): the same bytes, so every machine starts from the same model.
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    here = tiny.build_tiny_model(tmp_path / "here", seed=0)
    child = tiny._build_in_avx2_child(tmp_path / "child", 0, "tiny")
    assert _hashes(here) == _hashes(child)


def test_config_is_a_small_servable_qwen2(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] >= 512
    assert config["hidden_size"] <= 128 and config["num_hidden_layers"] <= 4
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert config["vocab_size"] == len(tok)
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert config["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    # Servers fill sampling defaults from generation_config.json: it must hold ids only.
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    gen.pop("transformers_version", None)
    assert gen == {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}


def test_save_and_reload_round_trip_generates(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = load_model(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    model.save_pretrained(tmp_path / "copy")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    for (name, p), (_, q) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Repeat: 7"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**ids, do_sample=True, max_new_tokens=6, temperature=1.0)
    new = out[0, ids["input_ids"].shape[1] :]
    assert 1 <= new.numel() <= 6
    assert isinstance(tok.decode(new), str)


def test_build_random_qwen2_sizes_and_validation(tmp_path: Path) -> None:
    out = tiny.build_random_qwen2(
        tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, seed=3, dtype=torch.bfloat16
    )
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.config.hidden_size == 32 and model.config.intermediate_size == 128
    assert model.config.num_key_value_heads == 2
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        tiny.build_random_qwen2(tmp_path / "x", hidden_size=30, num_layers=1, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        tiny.build_random_qwen2(
            tmp_path / "x", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=3
        )
    with pytest.raises(ValueError, match="init_std"):
        tiny.build_random_qwen2(
            tmp_path / "x", hidden_size=32, num_layers=1, num_heads=4, init_std=0.0
        )
    with pytest.raises(ValueError, match="vocab_size"):
        tiny.build_tokenizer(vocab_size=100)


# ---------------------------------------------------------------------------------------------
# Tokenizer, as vLLM/SGLang/transformers load it (AutoTokenizer)

ROUND_TRIP_TEXTS = [
    "Hello  world\n\nsecond line\n",
    "  leading and trailing spaces  ",
    "\t tabs\tand\r\nCRLF\r\n",
    "0123456789 42 3.14 -7 1,000,000 $18",
    "<answer>\n42\n</answer> <reasoning>\nstep 1\n</reasoning> <SOLUTION>0101</SOLUTION>",
    "(x1 OR ~x3 OR x4) AND (~x2 OR x5)\n#### 72",
    "Café naïve 漢字 🙂 — ‘quotes’",
    string.printable,
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_auto_tokenizer_round_trips_text_exactly(tiny_model_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.unk_token_id is None or tok.unk_token_id not in ids


def test_digits_are_single_tokens(tiny_model_dir: Path) -> None:
    # The copy task relies on this: "7" in the prompt and "7" in the answer are the same token.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("Repeat: 90817", add_special_tokens=False)
    digit_ids = [tok.convert_tokens_to_ids(d) for d in "90817"]
    assert ids[-5:] == digit_ids


def test_every_character_of_the_builtin_tasks_encodes_losslessly(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gsm8k = make_env("gsm8k", path=FIXTURES / "gsm8k_sample.jsonl", holdout_fraction=0.5)
    texts = [SAT_SYSTEM_PROMPT, GSM8K_SYSTEM_PROMPT]
    for env in (make_env("copy_digits"), make_env("sat"), gsm8k):
        for seed in range(5):
            problem = env.problem(seed)
            texts += [m["content"] for m in problem.prompt_messages] + [problem.answer]
            rendered = tok.apply_chat_template(
                problem.prompt_messages, add_generation_prompt=True, tokenize=False
            )
            ids = tok(rendered, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == rendered
    chars = sorted(set("".join(texts)))
    assert len(chars) > 40
    for ch in chars:
        assert tok.decode(tok.encode(ch, add_special_tokens=False)) == ch, repr(ch)


def test_chat_template_renders_qwen_format(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Repeat: 5"},
        {"role": "assistant", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nRepeat: 5<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("Repeat: 5<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # Special tokens are single ids and drop out of decoded completions.
    assert tok.decode([tok.convert_tokens_to_ids("7"), im_end], skip_special_tokens=True) == "7"


# The template before it rendered tools (BUILDER_VERSION 3), kept to check that every render
# without tools is byte for byte what it was: the default job's prompts, hence its token ids and
# metrics, must not move.
TEMPLATE_BEFORE_TOOLS = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_USER = {"role": "user", "content": "Repeat: 5"}
_SYSTEM = {"role": "system", "content": "Be brief.\nAnswer in <answer></answer>."}
_ASSISTANT = {"role": "assistant", "content": "5 <tool_call>\n{}\n</tool_call>"}
_AGAIN = {"role": "user", "content": " and again:\n\n7 "}
CONVERSATIONS = {
    "user": [_USER],
    "system + user": [_SYSTEM, _USER],
    "user, assistant, user": [_USER, _ASSISTANT, _AGAIN],
    "system + user, assistant, user": [_SYSTEM, _USER, _ASSISTANT, _AGAIN],
    "user, assistant": [_USER, _ASSISTANT],
    "empty contents": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
}


@pytest.fixture(scope="module")
def built_tokenizer() -> PreTrainedTokenizerFast:
    return tiny.build_tokenizer()


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_the_template_renders_what_it_did_before_tools(
    built_tokenizer: PreTrainedTokenizerFast, name: str, generation_prompt: bool
) -> None:
    tok = built_tokenizer
    assert tok.chat_template == tiny.CHAT_TEMPLATE != TEMPLATE_BEFORE_TOOLS
    messages = CONVERSATIONS[name]
    for tools in ({}, {"tools": None}, {"tools": []}):
        now = tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **tools
        )
        before = tok.apply_chat_template(
            messages,
            chat_template=TEMPLATE_BEFORE_TOOLS,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )
        assert now == before, tools


def test_the_default_tasks_prompt_ids_are_what_they_were(tiny_model_dir: Path) -> None:
    # The ids the default job sends, from the saved template as the servers load it.
    now = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert now.chat_template == tiny.CHAT_TEMPLATE, "template edited without a BUILDER_VERSION bump"
    before = AutoTokenizer.from_pretrained(tiny_model_dir)
    before.chat_template = TEMPLATE_BEFORE_TOOLS
    problems = [make_env("copy_digits").problem(seed) for seed in range(5)]
    problems.append(make_env("copy_digits", num_digits=3).problem(0))
    for problem in problems:
        ids = render_prompt_ids(now, problem)
        assert ids == render_prompt_ids(before, problem)
        assert now.decode(ids).endswith(
            f"Repeat: {problem.answer}<|im_end|>\n<|im_start|>assistant\n"
        )


def test_the_weights_are_the_ones_the_fingerprint_recorded(tiny_model_dir: Path) -> None:
    # Bumping BUILDER_VERSION for the template rebuilds the cache: the weights must come out the
    # same, or the default job's committed metrics (tests/data/fingerprint.json) would not hold.
    committed = json.loads((Path(__file__).parent / "data" / "fingerprint.json").read_text())
    recorded = {f["key"]["torch"]: f["model_sha256"] for f in committed["fingerprints"]}
    here = torch.__version__.split("+")[0]
    if here not in recorded or not torch.cpu._is_avx2_supported():
        pytest.skip(f"weights recorded for torch {sorted(recorded)} on AVX2 CPUs, not here")
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == recorded[here]


def test_files_stay_loadable_by_transformers_4(tiny_model_dir: Path) -> None:
    # vLLM/SGLang may run transformers 4.x (checked by hand with 4.57.1): it has no
    # "TokenizersBackend" class, fails on a list-valued `extra_special_tokens`, and reads the
    # top-level `rope_theta`, not transformers 5's `rope_parameters`.
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer"
    assert "extra_special_tokens" not in cfg
    assert cfg["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert isinstance(tiny.build_tokenizer(), PreTrainedTokenizerFast)


# ---------------------------------------------------------------------------------------------
# Cache


@pytest.fixture
def counted_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of the real builder behind ensure_tiny_model."""
    calls: list[int] = []
    real = tiny.build_tiny_model

    def counting(out_dir: Path, seed: int = 0, name: str = "tiny") -> Path:
        calls.append(seed)
        return real(out_dir, seed=seed, name=name)

    monkeypatch.setattr(tiny, "build_tiny_model", counting)
    return calls


def test_the_wide_preset_is_the_tiny_family_at_twice_the_width(tmp_path: Path) -> None:
    narrow = tiny.ensure_tiny_model(tmp_path, seed=0)
    wide = tiny.ensure_tiny_model(tmp_path, seed=0, name="tiny-wide")
    assert narrow.name.startswith("tiny-qwen2-") and wide.name.startswith("tiny-wide-qwen2-")
    a, b = (json.loads((d / "config.json").read_text()) for d in (narrow, wide))
    assert (a["hidden_size"], b["hidden_size"]) == (64, 128)
    assert a["num_hidden_layers"] == b["num_hidden_layers"] and a["vocab_size"] == b["vocab_size"]
    head = (
        a["hidden_size"] // a["num_attention_heads"],
        b["hidden_size"] // b["num_attention_heads"],
    )
    assert head == (16, 16)
    assert (narrow / "tokenizer.json").read_bytes() == (wide / "tokenizer.json").read_bytes()
    assert tiny.resolve_model("tiny-wide") == str(tiny.ensure_tiny_model(name="tiny-wide"))
    with pytest.raises(ValueError, match="no tiny preset 'tiny-huge'; known: tiny, tiny-wide"):
        tiny.ensure_tiny_model(tmp_path, name="tiny-huge")


def test_ensure_builds_once_then_reuses(tmp_path: Path, counted_builds: list[int]) -> None:
    first = tiny.ensure_tiny_model(tmp_path, seed=0)
    manifest = first / tiny.MANIFEST_NAME
    stamp = manifest.stat().st_mtime_ns
    second = tiny.ensure_tiny_model(tmp_path, seed=0)
    assert first == second and counted_builds == [0]
    assert manifest.stat().st_mtime_ns == stamp
    assert f"v{tiny.BUILDER_VERSION}" in first.name and first.name.endswith("seed0")
    recorded = json.loads(manifest.read_text())["files"]
    assert set(recorded) == set(_hashes(first)) - {tiny.MANIFEST_NAME}
    # A different seed is a different cache entry; nothing temporary is left behind.
    assert tiny.ensure_tiny_model(tmp_path, seed=1) != first and counted_builds == [0, 1]
    leftovers = [p.name for p in first.parent.iterdir() if ".build-" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_ensure_honours_grail_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_builds: list[int]
) -> None:
    monkeypatch.setenv("GRAIL_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny.ensure_tiny_model(seed=0)
    assert path.is_relative_to(tmp_path / "cache") and counted_builds == [0]


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_manifest", "delete_tokenizer"])
def test_ensure_rebuilds_a_corrupt_cache(
    tmp_path: Path, counted_builds: list[int], damage: str
) -> None:
    path = tiny.ensure_tiny_model(tmp_path, seed=0)
    good = _hashes(path)
    if damage == "truncate_weights":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "delete_manifest":
        (path / tiny.MANIFEST_NAME).unlink()
    else:
        (path / "tokenizer.json").unlink()
    assert tiny.manifest_problems(path), "the damage must be detected"
    again = tiny.ensure_tiny_model(tmp_path, seed=0)
    assert again == path and counted_builds == [0, 0]
    assert tiny.manifest_problems(again) == []
    assert _hashes(again) == good


def test_manifest_detects_an_edited_file_of_the_same_size(tmp_path: Path) -> None:
    path = tiny.ensure_tiny_model(tmp_path, seed=0)
    cfg = path / "config.json"
    data = bytearray(cfg.read_bytes())
    data[-3] = ord("x") if data[-3] != ord("x") else ord("y")
    cfg.write_bytes(bytes(data))
    assert tiny.manifest_problems(path) == ["config.json: sha256 mismatch"]


def test_concurrent_callers_build_once(tmp_path: Path, counted_builds: list[int]) -> None:
    barrier = threading.Barrier(3)

    def call() -> Path:
        barrier.wait()
        return tiny.ensure_tiny_model(tmp_path, seed=0)

    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: call(), range(3)))
    assert len(set(paths)) == 1 and counted_builds == [0]
    assert tiny.manifest_problems(paths[0]) == []


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_tokenizer_falls_back_to_eos_as_pad(tmp_path: Path) -> None:
    tok = tiny.build_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"


def test_missing_local_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("./not-here")
    with pytest.raises(FileNotFoundError):
        resolve_source("/abs/path/that/is/missing")


def test_unreachable_hub_says_so_and_suggests_a_local_path(no_network: None) -> None:
    assert resolve_source("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    with pytest.raises(OSError, match="unreachable") as err:
        load_tokenizer("grail-test-nonexistent/tiny-model")
    assert "local" in str(err.value) and "grail-test-nonexistent/tiny-model" in str(err.value)
    with pytest.raises(OSError, match="unreachable"):
        load_model("grail-test-nonexistent/tiny-model")


def test_dtype_names(tiny_model_dir: Path) -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert load_model(tiny_model_dir, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(tiny_model_dir, dtype="float8")


def _copy_without(model_dir: Path, dest: Path, *names: str) -> Path:
    dest.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in names:
            (dest / path.name).write_bytes(path.read_bytes())
    return dest


def test_a_directory_without_tokenizer_files_is_refused_naming_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # transformers would load it as a tokenizer with no vocabulary that encodes text to nothing.
    weights_only = _copy_without(tiny_model_dir, tmp_path / "m", "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer files") as err:
        load_tokenizer(weights_only)
    assert str(weights_only) in str(err.value) and "tokenizer.json" in str(err.value)
    load_model(weights_only)  # the weights alone still load


def test_a_directory_without_config_or_weights_is_refused_naming_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    no_config = _copy_without(tiny_model_dir, tmp_path / "a", "config.json")
    with pytest.raises(FileNotFoundError, match=f"{no_config} has no config.json"):
        load_model(no_config)
    no_weights = _copy_without(tiny_model_dir, tmp_path / "b", "model.safetensors")
    with pytest.raises(FileNotFoundError, match="has no weights") as err:
        load_model(no_weights)
    assert "model.safetensors" in str(err.value)
    assert model_dir_problems(tiny_model_dir) == []


def test_truncated_weights_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    cut = _copy_without(tiny_model_dir, tmp_path / "m")
    weights = cut / "model.safetensors"
    full = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: full // 2])
    with pytest.raises(FileNotFoundError, match="truncated") as err:
        load_model(cut)
    assert f"{weights}: truncated ({full // 2} bytes, its header needs {full})" in str(err.value)
    weights.write_bytes(b"\x05")  # not even a header
    with pytest.raises(FileNotFoundError, match=str(weights)):
        load_model(cut)
