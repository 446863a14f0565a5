"""Shared fixtures for the engine tests: the real SmolLM2 (loaded once), transformers' own load
of the same GGUF as the parity oracle, and tiny random-weight HF folders for each family.

Helpers (plain functions) are imported by the test modules with `from conftest import ...`.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zipage.engine import LLM, SamplingParams
from zipage.testing import save_random_model

TINY_FAMILIES = ("llama-tiny", "qwen2-tiny", "qwen3-tiny")

# Knobs every test engine shares: CPU, no compression (implemented separately), small pools.
BASE_KNOBS = dict(device="cpu", compression=False)

# The engine tests are dominated by many tiny ops; on a small shared CPU, intra-op threads spin
# against each other (and against other processes) and make tiny models 10-50x slower. One
# thread is fast and predictable; override with ZIPAGE_TEST_THREADS. Only these modules are
# affected (other test files keep torch's default).
ENGINE_TEST_MODULES = ("test_engine_", "test_kernels_reference", "test_service")


@pytest.fixture(scope="module", autouse=True)
def _engine_test_threads(request):
    name = request.module.__name__.rsplit(".", 1)[-1]
    if not name.startswith(ENGINE_TEST_MODULES):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("ZIPAGE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def _saved_chats_of_their_own(tmp_path_factory):
    """`zipage chat` saves every session: the tests' chats (the commands they start too) go to a folder
    of their own, never the user's."""
    os.environ["ZIPAGE_DATA"] = str(tmp_path_factory.mktemp("zipage-data"))
    yield


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with plain transformers forwards and a DynamicCache.

    No EOS handling and no logits processors at all (HF's min_new_tokens would mask EOS logits):
    this is argmax of the raw next-token logits, exactly what the engine does with
    temperature=0 and ignore_eos=True.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    x = torch.tensor([list(prompt_ids)])
    out = []
    for _ in range(max_new_tokens):
        logits = model(x, cache=cache, use_cache=True).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        x = torch.tensor([[token]])
    return out


def assert_pool_empty(engine) -> None:
    """Every block is free again and the accounting is exact."""
    engine.check_invariants()
    snap = engine.snapshot()
    assert not engine.requests, f"requests still live: {engine.requests}"
    assert snap.requests == ()
    assert snap.pool.free == snap.pool.total, f"{snap.pool.total - snap.pool.free} blocks still held"
    assert snap.pool.used == 0


# ------------------------------------------------------------------------------------------
# The real model


@pytest.fixture(scope="session")
def smol() -> LLM:
    """The built-in SmolLM2-135M-Instruct, loaded once per session (fp32 on CPU, dequantized as
    transformers loads it: the parity tests compare the two)."""
    llm = LLM("smollm2-135m", num_kv_blocks=512, weight_dtype="float32", **BASE_KNOBS)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def smol_hf(smol):
    """transformers' own float32 load of the same GGUF file: the parity oracle."""
    from transformers import AutoModelForCausalLM

    path = Path(smol.engine.source.path)
    assert path.suffix == ".gguf" and path.is_file()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


# ------------------------------------------------------------------------------------------
# Tiny random-weight models saved as HF folders


def build_tiny_hf(family: str, folder: Path, seed: int = 0):
    """A seeded random transformers model of the preset's shape, saved as an HF folder."""
    return save_random_model(folder, family, seed)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, SimpleNamespace]:
    """family -> (path of the saved HF folder, the transformers model)."""
    models = {}
    for i, family in enumerate(TINY_FAMILIES):
        folder = tmp_path_factory.mktemp(family)
        hf = build_tiny_hf(family, folder, seed=i)
        models[family] = SimpleNamespace(path=str(folder), hf=hf, config=hf.config)
    return models


@pytest.fixture(scope="session")
def tiny_path(tiny_models) -> str:
    """The tiny Llama folder: the default small model for engine behaviour tests."""
    return tiny_models["llama-tiny"].path


def tiny_llm(path: str, **kw) -> LLM:
    knobs = dict(BASE_KNOBS, block_size=16, num_kv_blocks=256)
    knobs.update(kw)
    return LLM(path, **knobs)


@pytest.fixture(scope="session")
def tiny(tiny_path) -> LLM:
    """One shared tiny Llama engine (block size 16, 256 blocks)."""
    llm = tiny_llm(tiny_path)
    yield llm
    llm.close()


def random_prompts(n: int, lengths, seed: int, vocab: int = 256) -> list[list[int]]:
    """n prompts of token ids (byte tokens, so they decode), lengths cycling through `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]
