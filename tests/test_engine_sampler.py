"""Sampling and stopping: temperature, top-k, top-p, min-p, repetition penalty, seeds, stop
strings, stop token ids, max_tokens and EOS."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_empty, greedy, random_prompts
from zipage.engine import SamplingParams
from zipage.engine.execution.sampler import (TOP_P_CANDIDATES, Sampler, apply_repetition_penalty, filter_logits,
                                             filtered_logits)
from zipage.kernels.reference import inverse_cdf

PROMPTS = random_prompts(3, [9, 30, 17], seed=91)
N = 24


@pytest.fixture(scope="module")
def greedy_out(tiny):
    return [o.token_ids for o in tiny.generate(PROMPTS, greedy(N, ignore_eos=True))]


def sample(llm, **kw):
    kw.setdefault("max_tokens", N)
    kw.setdefault("ignore_eos", True)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**kw))]


# ------------------------------------------------------------------------------------------
# The logits transforms against transformers' processors


def hf_chain(logits: torch.Tensor, context: list[int], p: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    ids = torch.tensor([context])
    x = logits[None].clone()
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.5, top_p=0.3),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, repetition_penalty=0.7, top_k=10),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}-r{p.repetition_penalty}")
def test_logits_transforms_match_transformers(params):
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        logits = torch.randn(200, generator=gen) * 3
        context = torch.randint(0, 200, (30,), generator=gen).tolist()
        ours = apply_repetition_penalty(logits, context, params.repetition_penalty)
        ours = filter_logits(ours, params)
        want = hf_chain(logits, context, params)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(ours[finite], want[finite])
        if params.top_k or params.top_p < 1 or params.min_p:
            assert (~finite).any()  # the filter really removed something on these logits


@pytest.mark.parametrize("spread, nucleus_inside", [(6.0, True), (0.05, False)], ids=["peaked", "flat"])
def test_top_p_on_a_large_vocabulary_matches_transformers(spread, nucleus_inside):
    """Past TOP_P_CANDIDATES tokens the CPU ranks only the most likely ones when they hold top_p
    (peaked rows) and sorts the whole row otherwise (flat rows): both keep transformers' tokens."""
    gen = torch.Generator().manual_seed(5)
    vocab = 4 * TOP_P_CANDIDATES
    for params in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.5),
                   SamplingParams(temperature=0.6, top_k=20, top_p=0.95)):
        logits = torch.randn(vocab, generator=gen) * spread
        ours, want = filter_logits(logits, params), hf_chain(logits, [], params)
        kept = torch.isfinite(want)
        assert torch.equal(torch.isfinite(ours), kept)
        torch.testing.assert_close(ours[kept], want[kept])
        assert (int(kept.sum()) <= TOP_P_CANDIDATES) == nucleus_inside or params.top_k


@pytest.mark.parametrize("vocab", [200, 4 * TOP_P_CANDIDATES], ids=["small", "large"])
def test_rows_filtered_together_equal_rows_filtered_alone(vocab):
    """A batch of rows with different temperatures and filters (ranked once for all of them) gives
    each row what filter_logits gives it alone; on the large vocabulary a flat row sends the whole
    batch to the full sort and a peaked batch stays among the candidates."""
    gen = torch.Generator().manual_seed(11)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.5, top_p=0.3)]
    for spreads in ([6.0] * len(params), [6.0, 6.0, 0.05, 6.0, 6.0, 6.0]):
        logits = torch.randn(len(params) + 2, vocab, generator=gen) * torch.tensor([1.0, *spreads, 1.0])[:, None]
        rows = list(range(1, len(params) + 1))
        together = filtered_logits(logits, rows, params)
        for i, (row, p) in enumerate(zip(rows, params)):
            alone = filter_logits(logits[row], p)
            assert torch.equal(torch.isfinite(together[i]), torch.isfinite(alone))
            torch.testing.assert_close(together[i], alone)


def kept_by_definition(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Which tokens of one row (already divided by its temperature) the filters keep, token by token
    and without ranking: top-k keeps every token at least the k-th largest logit; top-p keeps a token
    when the tokens strictly likelier than it (among those top-k kept) hold less than top_p; min-p
    keeps a token at least min_p times as likely as the likeliest."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < p.top_k < logits.numel():
        keep &= logits >= logits.sort(descending=True).values[p.top_k - 1]
    if p.top_p < 1.0:
        probs = logits.masked_fill(~keep, float("-inf")).double().softmax(-1)
        likelier = torch.stack([probs[logits > value].sum() for value in logits])
        keep &= (likelier < p.top_p) | (logits == logits.max())
    if p.min_p > 0.0:
        keep &= (logits - logits.max()).double().exp() >= p.min_p
    return keep


@pytest.mark.parametrize("vocab", [200, 4 * TOP_P_CANDIDATES], ids=["small", "large"])
def test_filters_keep_every_tie_as_their_definition_does(vocab):
    """Logits rounded to bf16 (as a bf16 model's head gives them) tie often, also at a row's k-th
    logit and past its leading candidates: every filter keeps a tie whole, as a definition that
    never ranks tokens does, whatever order a sort leaves tied tokens in."""
    gen = torch.Generator().manual_seed(13)
    cases = [SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=1.0, top_k=20, top_p=0.95),
             SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0, min_p=0.1),
             SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)]
    ties_past_candidates = 0
    for p in cases:
        for spread in (0.5, 4.0):
            logits = (torch.randn(vocab, generator=gen) * spread).bfloat16().float()
            if 0 < p.top_k:  # many tokens share the k-th logit, most of them far down the vocabulary
                kth = logits.sort(descending=True).values[p.top_k - 1]
                logits[torch.randperm(vocab, generator=gen)[:40]] = kth
                ties_past_candidates += int((logits == kth).sum()) > p.top_k
            kept = torch.isfinite(filter_logits(logits, p))
            assert torch.equal(kept, kept_by_definition(logits, p)), p
    assert ties_past_candidates  # the case where a tie runs past the top-k was really met


def test_inverse_cdf_never_picks_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0],
                          [0.0, 0.5, 0.0, 0.0, 0.0, 0.5, 0.0]])

    def pick(p, uniforms):
        return inverse_cdf(p, torch.tensor(uniforms, dtype=torch.float64)).tolist()

    assert pick(probs, [0.0, 0.0]) == [2, 1]  # the lowest u: the first possible token
    assert pick(probs, [1 - 2 ** -53] * 2) == [4, 5]  # the highest: the last one
    assert pick(probs, [0.2499, 0.5]) == [2, 5]  # u exactly at a boundary: the next token
    assert pick(probs * 3, [0.2501, 0.4999]) == [4, 1]  # unnormalised rows alike


def test_uniforms_drawn_together_equal_uniforms_drawn_row_by_row():
    """The rows without a generator of their own draw from the engine's in one call: the same
    numbers, in row order, as one draw a row, and a seeded row's number is its own stream's."""
    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    rows = [None, seeded(1), None, None, seeded(2), None]
    one_by_one, engine = [], seeded(0)
    for g, own in zip(rows, [None, seeded(1), None, None, seeded(2), None]):
        one_by_one.append(float(torch.rand((), dtype=torch.float64, generator=own or engine)))
    sampler = Sampler(0)
    assert sampler.uniforms(rows) == one_by_one
    assert len(set(one_by_one)) == len(rows)


def test_warm_up_leaves_the_engines_stream_as_it_was():
    """The start-up draws (one per kind of sampling kernel) take nothing from the engine's stream:
    the unseeded rows after them draw what they would have drawn without them."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(4))
    requests = [(SamplingParams(temperature=1.0), [], None)] * 2
    warmed, cold = Sampler(7), Sampler(7)
    warmed.warm_up(logits)
    draws = [warmed.sample(logits, requests) for _ in range(5)]
    assert draws == [cold.sample(logits, requests) for _ in range(5)]
    assert len({tuple(d) for d in draws}) > 1  # the draws really come from the stream


def test_repetition_penalty_on_known_values():
    logits = torch.tensor([2.0, -2.0, 0.5, -0.5, 1.0])
    out = apply_repetition_penalty(logits, [0, 1, 1, 3], 2.0)
    assert out.tolist() == [1.0, -4.0, 0.5, -1.0, 1.0]
    assert logits.tolist() == [2.0, -2.0, 0.5, -0.5, 1.0]  # not modified in place


def test_sampling_frequencies_follow_the_filtered_distribution():
    """Sampled tokens follow softmax(logits / T) restricted to the top-k."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, 3.0])
    params = SamplingParams(temperature=0.8, top_k=4)
    rows = 4000
    gen = torch.Generator().manual_seed(0)
    tokens = Sampler(0).sample(logits.repeat(rows, 1), [(params, [], gen)] * rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float() / rows
    want = torch.zeros(6)
    top = [5, 0, 1, 2]
    want[top] = torch.softmax(logits[top] / 0.8, dim=0)
    assert counts[3] == 0 and counts[4] == 0
    torch.testing.assert_close(counts, want, atol=0.03, rtol=0)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)] * 3
    tokens = Sampler(0).sample(logits, [(p, [], None) for p in params])
    for i in (0, 2, 4):
        assert tokens[i] == int(logits[i].argmax())


# ------------------------------------------------------------------------------------------
# End to end on the tiny model


def test_greedy_output_is_not_degenerate(greedy_out):
    for tokens in greedy_out:
        assert len(set(tokens)) > 6


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.5, top_p=1e-6),
    dict(temperature=2.0, min_p=1.0),
    dict(temperature=1e-4, seed=5),
], ids=["top_k=1", "top_p~0", "min_p=1", "tiny-temperature"])
def test_filters_that_leave_one_token_equal_greedy(tiny, greedy_out, kw):
    assert sample(tiny, **kw) == greedy_out


def test_seeded_requests_reproduce_and_differ_by_seed(tiny, greedy_out):
    a = sample(tiny, temperature=1.0, seed=1234)
    b = sample(tiny, temperature=1.0, seed=1234)
    c = sample(tiny, temperature=1.0, seed=4321)
    assert a == b
    assert a != c
    assert a != greedy_out
    # The same seed inside one batch: identical prompts give identical samples, whatever else runs.
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=N, ignore_eos=True)
    outs = tiny.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], params)
    assert outs[0].token_ids == outs[2].token_ids
    alone = tiny.generate([PROMPTS[0]], params)[0]
    assert alone.token_ids == outs[0].token_ids


def test_unseeded_sampling_varies(tiny):
    outs = tiny.generate([PROMPTS[0]] * 4, SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_low_temperature_sampling_is_closer_to_greedy(tiny, greedy_out):
    def agreement(tokens):
        return sum(x == y for a, b in zip(tokens, greedy_out) for x, y in zip(a, b))

    cold = sample(tiny, temperature=0.05, seed=9)
    hot = sample(tiny, temperature=3.0, seed=9)
    assert agreement(cold) > agreement(hot)


def test_repetition_penalty_matches_transformers_greedy(tiny, tiny_models):
    """Greedy with repetition_penalty=3.0 equals a transformers loop applying
    RepetitionPenaltyLogitsProcessor over prompt + output before the argmax."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf = tiny_models["llama-tiny"].hf
    proc = RepetitionPenaltyLogitsProcessor(3.0)
    prompt = PROMPTS[0]  # its greedy continuation revisits a token, so the penalty changes it
    outs = tiny.generate([prompt], greedy(N, ignore_eos=True, repetition_penalty=3.0))[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(N):
            logits = hf(torch.tensor([ids])).logits[:, -1]
            ids.append(int(proc(torch.tensor([ids]), logits).argmax()))
    assert outs.token_ids == ids[len(prompt):]
    plain = tiny.generate([prompt], greedy(N, ignore_eos=True))[0]
    assert outs.token_ids != plain.token_ids


def test_max_tokens_gives_length(tiny, greedy_out):
    for n in (1, 5):
        out = tiny.generate([PROMPTS[0]], greedy(n, ignore_eos=True))[0]
        assert out.token_ids == greedy_out[0][:n] and out.finish_reason == "length"


def test_stop_token_ids(tiny, greedy_out):
    tokens = greedy_out[1]
    stop = tokens[5]
    first = tokens.index(stop)
    out = tiny.generate([PROMPTS[1]], greedy(N, ignore_eos=True, stop_token_ids=[stop, 999_999]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[:first + 1]
    assert_pool_empty(tiny.engine)


def test_eos_stops_unless_ignore_eos(tiny):
    """The tiny model's EOS is token 256. Find a prompt whose greedy output contains it."""
    eos = 256
    assert tiny.engine.eos_token_ids == {eos}
    candidates = random_prompts(40, [3, 6, 11], seed=5)
    outs = tiny.generate(candidates, greedy(16, ignore_eos=True))
    hits = [(p, o.token_ids) for p, o in zip(candidates, outs) if eos in o.token_ids]
    assert hits, "no prompt produced EOS; pick another seed"
    prompt, full = hits[0]
    cut = full.index(eos)
    stopped = tiny.generate([prompt], greedy(16))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full[:cut + 1]
    assert "<|endoftext|>" not in stopped.text


# ------------------------------------------------------------------------------------------
# Stop strings and EOS on the real model (real text)


@pytest.fixture(scope="module")
def fib(smol):
    prompt = "def fibonacci(n):\n"
    out = smol.generate([prompt], greedy(40, ignore_eos=True))[0]
    return prompt, out


def test_stop_string_cuts_text(smol, fib):
    prompt, full = fib
    assert "return" in full.text
    stop = "return"
    out = smol.generate([prompt], greedy(40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert stop not in out.text
    # Generation stopped at the token completing the stop string.
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert stop in smol.tokenizer.decode(out.token_ids)
    assert stop not in smol.tokenizer.decode(out.token_ids[:-1])

    kept = smol.generate([prompt], greedy(40, ignore_eos=True, stop=stop, stop_strings_in_output=True))[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]
    assert kept.token_ids == out.token_ids


def test_stop_string_streaming_never_emits_the_stop(smol, fib):
    """Through the streaming path (EngineCore stream=True), deltas add up to the cut text."""
    prompt, full = fib
    engine = smol.engine
    seq = engine.add_request(prompt, greedy(40, ignore_eos=True, stop=["return"]), stream=True)
    deltas, final = [], None
    while final is None:
        for out in engine.step():
            if out.id == seq.id:
                deltas.append(out.delta)
                final = out if out.finished else None
    assert final.finish_reason == "stop"
    assert "".join(deltas) == final.text == full.text[:full.text.index("return")]
    assert sum(1 for d in deltas if d) > 3


def test_earliest_of_several_stop_strings_wins(smol, fib):
    prompt, full = fib
    text = full.text
    later, earlier = "return", text[text.index("return") - 6:text.index("return") - 2]
    assert earlier and text.index(earlier) < text.index(later)
    out = smol.generate([prompt], greedy(40, ignore_eos=True, stop=[later, earlier]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(earlier)]


def test_stop_string_not_in_output_runs_to_length(smol, fib):
    prompt, full = fib
    out = smol.generate([prompt], greedy(40, ignore_eos=True, stop=["<never appears>"]))[0]
    assert out.finish_reason == "length" and out.text == full.text


def test_real_model_eos_stops_unless_ignore_eos(smol):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    stopped = smol.chat(messages, greedy(48))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[-1] in smol.engine.eos_token_ids
    assert len(stopped.token_ids) < 48
    assert "4" in stopped.text and "<|im_end|>" not in stopped.text
    forced = smol.chat(messages, greedy(48, ignore_eos=True))
    assert forced.finish_reason == "length" and len(forced.token_ids) == 48
    assert forced.token_ids[:len(stopped.token_ids)] == stopped.token_ids


def test_ids_without_text_keep_the_decoding_window_short():
    """Random-weight models mostly sample ids past their byte tokenizer's vocabulary: they decode to
    nothing and never enter the window re-decoded per token, even while a character is incomplete."""
    import random

    from zipage.engine.loading.detokenizer import IncrementalDetokenizer
    from zipage.engine.loading.loader import resolve_model

    tok = resolve_model("random:qwen3-0.6b").tokenizer
    rng = random.Random(5)
    ids = [rng.randrange(151936) for _ in range(400)]
    ids[50:50] = [0xE2, 151000, 0x82, 150000, 0xAC]  # "€" split, with silent ids inside it
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([t]) for t in ids) + detok.finish()
    assert streamed == tok.decode(ids) and "€" in streamed
    assert len(detok.window) == sum(t < len(tok) for t in ids) < 10


@pytest.mark.parametrize("skip_special", [True, False])
def test_streamed_text_equals_tokenizer_decode(smol, skip_special):
    """The detokenizer decodes through the Rust tokenizer directly; streamed deltas (ids added a
    few at a time, special tokens and split UTF-8 characters among them) join into exactly
    transformers' decode of the whole output."""
    import random

    from zipage.engine.loading.detokenizer import IncrementalDetokenizer

    tok = smol.tokenizer
    rng = random.Random(3)
    ids = [rng.randrange(tok.vocab_size) for _ in range(120)]
    ids[10:10] = list(tok.all_special_ids)
    ids[40:40] = tok.encode("naïve café ☕ 東京", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special)
    streamed, i = "", 0
    while i < len(ids):
        step = rng.randint(1, 3)
        streamed += detok.add(ids[i:i + step])
        i += step
    streamed += detok.finish()
    assert streamed == tok.decode(ids, skip_special_tokens=skip_special)
