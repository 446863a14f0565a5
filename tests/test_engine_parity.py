"""Greedy parity with transformers: the real SmolLM2 GGUF and tiny random Llama/Qwen2/Qwen3."""

from __future__ import annotations

import pytest

from conftest import TINY_FAMILIES, greedy, hf_greedy, random_prompts, tiny_llm

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
SMOL_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def smol_runs(smol, smol_hf):
    """Engine outputs (one batch, EOS ignored) and transformers' greedy continuation per prompt."""
    chat = smol.engine.apply_chat_template([{"role": "user", "content": "Name three primary colours."}])
    prompts = SMOL_PROMPTS + [chat]
    outs = smol.generate(prompts, greedy(SMOL_NEW_TOKENS, ignore_eos=True))
    refs = [hf_greedy(smol_hf, out.prompt_token_ids, SMOL_NEW_TOKENS) for out in outs]
    return prompts, outs, refs


def test_smollm2_greedy_equals_transformers(smol, smol_runs):
    prompts, outs, refs = smol_runs
    for prompt, out, ref in zip(prompts, outs, refs):
        if isinstance(prompt, str):
            assert out.prompt_token_ids == smol.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"
        assert len(out.token_ids) == SMOL_NEW_TOKENS
        assert out.token_ids == ref, f"prompt {prompt!r}: first divergence at " \
            f"{next(i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)}"
        assert out.text == smol.tokenizer.decode(ref, skip_special_tokens=True)


def test_smollm2_greedy_stops_at_eos_like_transformers(smol, smol_runs):
    """Without ignore_eos the engine's tokens are transformers' greedy tokens up to the first EOS."""
    prompts, _, refs = smol_runs
    eos = smol.engine.eos_token_ids
    assert eos, "the model declares no EOS token"
    outs = smol.generate(prompts, greedy(SMOL_NEW_TOKENS))
    stopped = 0
    for out, ref in zip(outs, refs):
        cut = next((i for i, t in enumerate(ref) if t in eos), None)
        if cut is None:
            assert out.token_ids == ref and out.finish_reason == "length"
        else:
            stopped += 1
            assert out.token_ids == ref[:cut + 1]
            assert out.finish_reason == "stop"
    # The chat prompt is answered briefly and ends with <|im_end|>: the EOS path really ran.
    assert stopped >= 1


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_random_model_greedy_equals_transformers(tiny_models, family):
    model = tiny_models[family]
    llm = tiny_llm(model.path, num_kv_blocks=64)
    # The engine really built the family's switches from the saved config.
    attn = llm.engine.runner.model.attention_layers[0]
    assert (attn.qkv_proj.bias is not None) == (family == "qwen2-tiny")
    assert attn.qk_norm == (family == "qwen3-tiny")
    if family == "llama-tiny":
        assert model.config.rope_parameters["rope_type"] == "llama3"

    prompts = random_prompts(3, [5, 23, 41], seed=7) + ["Hello, tiny world! 123"]
    new_tokens = 40
    outs = llm.generate(prompts, greedy(new_tokens, ignore_eos=True))
    for out in outs:
        ref = hf_greedy(model.hf, out.prompt_token_ids, new_tokens)
        assert len(set(ref)) > 8, f"degenerate reference output {ref}: the test would prove little"
        assert out.token_ids == ref
    # Prompts of different content give different continuations.
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)


def test_tiny_parity_holds_past_many_blocks(tiny_models):
    """A long prompt (many blocks of 16) and a long generation crossing block boundaries."""
    model = tiny_models["qwen3-tiny"]
    llm = tiny_llm(model.path, num_kv_blocks=64)
    prompt = random_prompts(1, [150], seed=3)[0]
    out = llm.generate([prompt], greedy(70, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model.hf, prompt, 70)



def test_cpu_engine_computes_from_packed_weights(smol):
    """On the CPU the projections and the tied LM head run from oneDNN-packed weights (where this
    torch has them); the parity tests above run through them. A packed layer equals F.linear on
    the plain weight it replaced."""
    import torch
    import torch.nn.functional as F

    from zipage.engine.execution.models.decoder import Linear, cpu_packing_works

    if not cpu_packing_works(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linear")
    model = smol.engine.runner.model
    assert smol.engine.runner.packed_weights
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.packed is not None and m.weight is None for m in layers)
    gen = torch.Generator().manual_seed(0)
    plain = Linear(64, 96, bias=True)
    with torch.no_grad():
        plain.weight.normal_(generator=gen)
        plain.bias.normal_(generator=gen)
    weight, bias = plain.weight.detach().clone(), plain.bias.detach().clone()
    x = torch.randn(7, 64, generator=gen)
    plain.pack_for_cpu()
    torch.testing.assert_close(plain(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    hidden = torch.randn(3, model.config.hidden_size, generator=gen)
    torch.testing.assert_close(model.logits(hidden), F.linear(hidden, model.model.embed_tokens.weight),
                               rtol=1e-5, atol=1e-4)
