"""Fixtures every evaluation test module takes (import them into the module: they are autouse)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Each test its own evaluation cache: no answers shared between tests or with the user's."""
    monkeypatch.setenv("ZIPAGE_EVAL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run many small ops: one thread is fastest and steady on a busy CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
