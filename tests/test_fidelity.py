"""The fidelity evaluation: its KL estimate, and knobs set on top of every row (the shared behaviour
of every task is in test_eval_suite.py)."""

from __future__ import annotations

import pytest
import torch

from zipage.cli.eval import common as ec
from zipage.cli.eval import fidelity


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


def test_settings_apply_on_top_of_every_row(tiny_path, tmp_path, monkeypatch):
    """Set to sinks + recent, the default row is exactly the sinks + recent row."""
    monkeypatch.setenv("ZIPAGE_EVAL_CACHE", str(tmp_path))
    settings = ec.parse_settings(["eviction=recent", "num_sink_tokens=4"])
    assert settings == {"eviction": "recent", "num_sink_tokens": 4}
    results = fidelity.run(tiny_path, num_samples=2, tokens=24, budgets=ec.parse_budgets("1"), block_size=16,
                           window=4, configurations=["default", "sinks + recent"], settings=settings)
    default, baseline = (r["by_budget"]["1 blocks"] for r in results["rows"][1:])
    assert results["rows"][1]["overrides"]["eviction"] == "recent"
    assert default["compressions"] > 0 and default == {**baseline, "seconds": default["seconds"]}
