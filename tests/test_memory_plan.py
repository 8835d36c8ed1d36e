"""benchmarks/memory_plan.py: its arithmetic on a shape small enough to count by hand, the
parameter counts of the real Qwen2.5 shapes, the direction every term moves in, and its error
against the peaks measured on one GPU."""

from __future__ import annotations

import json
import sys
from itertools import pairwise
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import memory_plan as mp  # noqa: E402

# hidden 8, 2 layers, 2 heads of 4 (kv: 1 head, 4 wide), MLP 16, vocabulary 32, tied
TINY = mp.Shape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=32, tied=True)


def test_a_small_shape_counted_by_hand() -> None:
    # layer: q 8*8+8, k and v 8*4+4 each, o 8*8, MLP 3*8*16, two norms 2*8 = 608
    assert TINY.layer_params() == 72 + 36 + 36 + 64 + 384 + 16 == 608
    assert TINY.root_params() == 32 * 8 + 8 == 264  # tied: one embedding matrix, final norm
    p = 2 * 608 + 264
    assert TINY.params() == p == 1480

    one = mp.plan("tiny", 1, 10, shape=TINY)
    # per token per layer under autocast: 32h + 4kv + 8I = 256 + 16 + 128; 8h after the layers
    act = 10 * (2 * 400 + 64)
    head = 4 * 10 * 32 + 12 * 10 * 32  # 10 positions of bf16 logits + gradient, float32 block
    assert one.activations * mp.GIB == pytest.approx(act) == 8640
    assert one.head_logits * mp.GIB == pytest.approx(head) == 5120
    assert one.bf16_copies * mp.GIB == pytest.approx(2 * p)
    assert one.total * mp.GIB == pytest.approx(16 * p + 2 * p + head + act) == 40400
    # checkpointing keeps each layer's float32 input (4h) and recomputes one layer
    assert one.activations_ckpt * mp.GIB == pytest.approx(10 * (2 * 32 + 400 + 64))
    assert one.total_ckpt_ref * mp.GIB == pytest.approx(37040 + 4 * p)

    two = mp.plan("tiny", 2, 10, shape=TINY)
    # bf16 parameters: 22h + 4kv + 8I = 320 per layer; root gathered (2R params + 2R grads),
    # two layers in flight (2 x 2 P_layer) and one layer's gradient reduce (6 P_layer)
    assert two.activations * mp.GIB == pytest.approx(10 * (2 * 320 + 64))
    assert two.bf16_copies * mp.GIB == pytest.approx(4 * 264 + 4 * 608 + 6 * 608)
    assert two.params * mp.GIB == pytest.approx(4 * p / 2)
    assert two.total * mp.GIB == pytest.approx(8 * p + 7136 + 5120 + 7040) == 31136


def test_the_qwen_shapes_have_their_published_parameter_counts() -> None:
    # the safetensors totals of Qwen/Qwen2.5-{0.5B,1.5B,7B,14B,32B} on the Hugging Face hub
    assert {k: s.params() for k, s in mp.QWEN25.items()} == {
        "0.5B": 494_032_768,
        "1.5B": 1_543_714_304,
        "7B": 7_615_616_512,
        "14B": 14_770_033_664,
        "32B": 32_763_876_352,
    }


@pytest.mark.parametrize("model", list(mp.QWEN25))
def test_more_gpus_less_per_rank_more_tokens_more(model: str) -> None:
    by_gpus = [mp.plan(model, n, 4096) for n in (1, 2, 4, 8, 16)]
    for fewer, more in pairwise(by_gpus):
        assert more.total < fewer.total and more.total_ckpt < fewer.total_ckpt
        assert more.params + more.grads + more.adam < fewer.params + fewer.grads + fewer.adam
    for n in (1, 8):
        by_tokens = [mp.plan(model, n, t) for t in (512, 4096, 16384)]
        for small, large in pairwise(by_tokens):
            assert large.activations > small.activations and large.total > small.total
        for p in by_tokens:  # checkpointing saves memory; the reference model costs some
            assert p.activations_ckpt < p.activations and p.total_ckpt < p.total
            assert p.total_ckpt_ref > p.total_ckpt


def test_larger_models_need_more_at_every_gpu_count() -> None:
    for n in (1, 2, 4, 8):
        totals = [mp.plan(m, n, 4096).total for m in mp.QWEN25]
        assert totals == sorted(totals)


def test_one_gpu_lands_near_the_measured_peaks() -> None:
    rows = mp.check()
    assert [(r["model"], r["tokens"]) for r in rows] == [
        ("0.5B", 4096),
        ("0.5B", 16384),
        ("1.5B", 16384),
    ]
    assert all(abs(float(r["error"])) < 0.03 for r in rows)  # 1.9%, -1.8%, -1.1% today


def test_the_script_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert mp.main(["--models", "0.5B", "32B", "--gpus", "1", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 0.5B |") == 2 and "| 32B | 32.76 B | 8 |" in out
    assert mp.main(["--json", "--models", "7B", "--gpus", "4"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["model"] == "7B" and row["gpus"] == 4 and row["fits"] is True
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        mp.plan("7B", 0, 4096)
