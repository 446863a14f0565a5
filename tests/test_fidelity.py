"""The fidelity evaluation: its KL estimate, and agreement/KL on a tiny model where the answer is
known (a budget never reached must match full KV exactly)."""

from __future__ import annotations

import pytest
import torch

from zipage.cli import fidelity


def _exact_kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> float:
    return float((p_logp.exp() * (p_logp - q_logp)).sum())


def test_kl_top_k_is_exact_when_the_top_k_covers_the_vocabulary():
    gen = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(50, generator=gen) * 3, dim=-1)
    q = torch.log_softmax(torch.randn(50, generator=gen) * 3, dim=-1)
    top = torch.topk(p, 50)
    assert fidelity.kl_top_k(top.values, top.indices, q) == pytest.approx(_exact_kl(p, q), rel=1e-5)


def test_kl_top_k_lumps_the_tail_and_never_exceeds_the_exact_kl():
    """Merging the tail into one bucket is a coarse-graining, which can only lower KL."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        p = torch.log_softmax(torch.randn(200, generator=gen) * 2, dim=-1)
        q = torch.log_softmax(torch.randn(200, generator=gen) * 2, dim=-1)
        top = torch.topk(p, 20)
        approx = fidelity.kl_top_k(top.values, top.indices, q)
        assert 0.0 <= approx <= _exact_kl(p, q) + 1e-6
    assert fidelity.kl_top_k(top.values, top.indices, p) == pytest.approx(0.0, abs=1e-6)


def test_a_budget_never_reached_agrees_with_full_kv_exactly(tiny_path):
    results = fidelity.run(tiny_path, num_prompts=2, tokens=24, budgets=[8, 1], block_size=16, window=4,
                           configurations=["+ recent share (Zipage)", "random eviction"], progress=lambda line: None)
    assert [r["configuration"] for r in results["rows"]] == ["+ recent share (Zipage)", "random eviction"]
    for row in results["rows"]:
        never = row["by_budget"]["8"]  # 128 tokens of budget: prompt plus 24 tokens never reach it
        assert never["compressions"] == 0 and never["steps"] == 2 * 24
        assert never["agreement"] == 1.0 and never["mean_kl"] == pytest.approx(0.0, abs=1e-6)
        squeezed = row["by_budget"]["1"]  # a 16-token budget: the prompt alone outgrows it
        assert squeezed["compressions"] > 0 and squeezed["mean_kl"] > 0.0


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="unknown configuration 'bogus'"):
        fidelity.run("random:llama-tiny", configurations=["bogus"])


def test_settings_apply_on_top_of_every_row(tiny_path):
    """With the recent share set to 0, the default row is exactly the pure-scoring row."""
    settings = fidelity.parse_settings(["recent_share=0", "enable_pooling=true"])
    assert settings == {"recent_share": 0, "enable_pooling": True}
    results = fidelity.run(tiny_path, num_prompts=2, tokens=24, budgets=[1], block_size=16, window=4,
                           configurations=["+ pooling", "+ recent share (Zipage)"], settings=settings,
                           progress=lambda line: None)
    pure, recent = (r["by_budget"]["1"] for r in results["rows"])
    assert results["rows"][1]["overrides"]["recent_share"] == 0
    assert pure == {**recent, "seconds": pure["seconds"]}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="expected KNOB=VALUE"):
        fidelity.parse_settings(["recent_share"])
    with pytest.raises(ValueError, match="unknown engine knob 'bogus'"):
        fidelity.parse_settings(["bogus=1"])
