"""bench --models' machinery on the CPU with a tiny decoder and encoder: each attention's training
step runs and its first loss is judged against SDPA's (the GPU grid runs the full-size models)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from cupyflash.bench import models  # noqa: E402


def tiny():
    return [models.llama(64, tokens=128, layers=1, hidden=32, heads=4, kv_heads=2, vocab=50),
            models.bert(batch=3, seqlen=32, layers=1, hidden=32, heads=4, vocab=50, shortest=8)]


@pytest.mark.parametrize("method", ["sdpa", "cupyflash", "cupyflash-compiled"])
def test_a_training_step_of_each_model(method):
    for workload in tiny():
        row = models.run(workload, method, steps=2, warmup=1, dtype=torch.float32, device="cpu")
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["first_loss"] > 0
        torch._dynamo.reset()


def test_first_losses_are_judged_against_sdpas():
    rows = [models.run(w, m, steps=1, warmup=0, dtype=torch.float32, device="cpu")
            for w in tiny()[:1] for m in ("sdpa", "cupyflash")]
    assert models.loss_verdicts(rows) == []
    assert abs(rows[1]["loss_vs_sdpa"]) < 1e-3 * rows[0]["first_loss"]
    wrong = [dict(rows[0]), dict(rows[1], first_loss=rows[1]["first_loss"] * 1.01)]
    assert len(models.loss_verdicts(wrong)) == 1


def test_flash_attn_missing_is_a_skip():
    if models.importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(models.Skip, match="flash-attn is not installed"):
        models.run(tiny()[0], "flash-attn", steps=1, warmup=0, dtype=torch.float32, device="cpu")


def test_the_loss_curve_learns_and_is_judged_by_the_seed_spread():
    blocks = models.corpus(60, 4, 32, 64)
    tiny = dict(layers=2, hidden=64, heads=4, vocab=64)
    curves = {"sdpa seed 0": models.loss_curve("sdpa", 0, blocks, torch.float32, "cpu", **tiny),
              "sdpa seed 1": models.loss_curve("sdpa", 1, blocks, torch.float32, "cpu", **tiny),
              "cupyflash": models.loss_curve("cupy_attention", 0, blocks, torch.float32, "cpu", **tiny)}
    assert curves["sdpa seed 0"][-1] < 0.9 * curves["sdpa seed 0"][0], "the model did not learn"
    assert models.curve_verdict(curves, tail=5)[0]
    spread = abs(sum(curves["sdpa seed 1"][-5:]) - sum(curves["sdpa seed 0"][-5:])) / 5
    shifted = dict(curves, cupyflash=[x + 2 * spread + 1e-2 for x in curves["cupyflash"]])
    assert not models.curve_verdict(shifted, tail=5)[0]


def test_a_forced_backend_that_cannot_take_the_mask_is_a_skip():
    with pytest.raises(models.Skip, match="takes no attn_mask"):
        models.run(tiny()[1], "sdpa-flash", steps=1, warmup=0, dtype=torch.float32, device="cpu")
