"""Frequency and presence penalties against a plain-PyTorch reference of OpenAI's definition:
logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0), counted over the
output tokens only."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from compression_helpers import SMALL_BUDGET, build_random_model, random_prompts
from zipage.engine import LLM, SamplingParams
from zipage.engine.execution.penalties import apply_count_penalties
from zipage.engine.execution.sampler import Sampler

PENALTIES = [(0.5, 0.0), (0.0, 1.5), (1.2, 0.7), (-0.8, 0.3), (2.0, -2.0)]  # (frequency, presence)


def reference(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's definition, one token at a time."""
    out = logits.clone()
    for token, count in Counter(output).items():
        out[token] -= frequency * count + presence
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-penalties"), "qwen3-tiny", seed=11)


@pytest.fixture(scope="module")
def model_logits(model_path) -> torch.Tensor:
    """Next-token logits of a real (tiny, random) model after a few prompts, one row each."""
    rows = []
    with LLM(model_path, device="cpu", compression=False) as llm:
        llm.engine.observe_logits(lambda seq, row: rows.append(row.clone()))
        llm.generate(random_prompts(4, [6, 11, 17, 9], seed=4), SamplingParams(temperature=0.0, max_tokens=1))
    return torch.stack(rows)


def test_known_values():
    logits = torch.zeros(2, 6)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = apply_count_penalties(logits, [1], [params], [[2, 2, 3]])
    assert out[1].tolist() == [0.0, 0.0, -2.0, -1.5, 0.0, 0.0]
    assert out[0].tolist() == [0.0] * 6 and logits.eq(0).all()  # other rows and the input are kept


@pytest.mark.parametrize("frequency, presence", PENALTIES)
def test_penalised_logits_equal_the_reference_on_model_logits(model_logits, frequency, presence):
    gen = torch.Generator().manual_seed(1)
    vocab = model_logits.shape[-1]
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (0, 5, 40, 300)]
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    ours = apply_count_penalties(model_logits, [0, 1, 2, 3], [params] * 4, outputs)
    for row, output in enumerate(outputs):
        torch.testing.assert_close(ours[row], reference(model_logits[row], output, frequency, presence))


@pytest.mark.parametrize("frequency, presence", PENALTIES)
def test_greedy_choice_beside_unpenalised_rows(model_logits, frequency, presence):
    """Penalised rows choose the reference's argmax; rows without penalties keep the raw argmax. Each
    output repeats the raw favourite, so the penalty has something to push down."""
    rows = len(model_logits)
    favourites = model_logits.argmax(-1).tolist()
    outputs = [[favourites[i]] * (1 + i) + [7, 7, 3] for i in range(rows)]
    penalised = SamplingParams(temperature=0.0, frequency_penalty=frequency, presence_penalty=presence)
    plain = SamplingParams(temperature=0.0)
    params = [penalised if i % 2 == 0 else plain for i in range(rows)]
    prompt = [5, 6, 9]  # the prompt does not count
    requests = [(p, prompt + out, None) for p, out in zip(params, outputs)]
    chosen = Sampler(0).sample(model_logits, requests, prompt_lens=[len(prompt)] * rows)
    for i in range(rows):
        if i % 2 == 0:
            want = reference(model_logits[i], outputs[i], frequency, presence).argmax()
        else:
            want = model_logits[i].argmax()
        assert chosen[i] == int(want)


def test_sampled_distribution_follows_the_penalised_reference(model_logits):
    """Sampling at temperature 0.8 among the top 5 of the penalised logits: frequencies follow the
    reference's softmax over those 5 tokens."""
    row = model_logits[0]
    top = row.topk(3).indices.tolist()
    output = [top[0]] * 3 + [top[1]]  # the favourite pushed down hard, the runner-up a little
    params = SamplingParams(temperature=0.8, top_k=5, frequency_penalty=0.4, presence_penalty=0.3)
    n = 6000
    gen = torch.Generator().manual_seed(0)
    tokens = Sampler(0).sample(row.repeat(n, 1), [(params, output, gen)] * n)
    want_logits = reference(row, output, 0.4, 0.3) / 0.8
    kept = want_logits.topk(5).indices
    want = torch.zeros_like(row)
    want[kept] = want_logits[kept].softmax(-1)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(row)).float() / n
    assert set(torch.tensor(tokens).unique().tolist()) <= set(kept.tolist())
    torch.testing.assert_close(counts, want, atol=0.03, rtol=0)
    assert int(want.argmax()) != top[0]  # the penalty did change the distribution: the favourite lost its place


@pytest.mark.parametrize("compression", [False, True], ids=["full KV", "compressed"])
def test_every_engine_step_chooses_the_reference_argmax(model_path, compression):
    """A batch of requests with and without penalties, greedy: at every step, each penalised request's
    token is the argmax of the reference applied to that step's raw logits and its output so far; the
    others decode exactly as they do alone."""
    prompts = random_prompts(4, [9, 20, 14, 30], seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, frequency_penalty=f, presence_penalty=p)
              for f, p in [(0.9, 0.0), (0.0, 0.0), (0.4, 1.1), (-0.3, 0.6)]]
    knobs = dict(SMALL_BUDGET, compression=compression, num_kv_blocks=128)
    seen = []
    with LLM(model_path, **knobs) as llm:
        llm.engine.observe_logits(lambda seq, row: seen.append((seq.id, list(seq.output_token_ids), row.clone())))
        outs = llm.generate(prompts, params)
        alone = llm.generate([prompts[1]], params[1])[0]
        assert (llm.engine.totals["compressions"] > 0) == compression
    by_id = {out.id: (out, p) for out, p in zip(outs, params)}
    steps = 0
    for request_id, before, row in seen:
        if request_id not in by_id:
            continue
        out, p = by_id[request_id]
        token = out.token_ids[len(before)]
        assert before == out.token_ids[:len(before)]
        assert token == int(reference(row, before, p.frequency_penalty, p.presence_penalty).argmax())
        steps += 1
    assert steps == 4 * 60
    assert outs[1].token_ids == alone.token_ids
    plain = LLM(model_path, **knobs)
    try:
        unpenalised = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    finally:
        plain.close()
    assert sum(a.token_ids != b.token_ids for a, b in zip(outs, unpenalised)) >= 2  # the penalties mattered


def test_zero_penalties_leave_greedy_output_unchanged(model_path):
    prompts = random_prompts(3, [8, 15, 26], seed=8)
    with LLM(model_path, **dict(SMALL_BUDGET, num_kv_blocks=128)) as llm:
        default = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        zero = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                    frequency_penalty=0.0, presence_penalty=0.0))
    assert [o.token_ids for o in zero] == [o.token_ids for o in default]


@pytest.mark.parametrize("field, value", [("frequency_penalty", 2.5), ("presence_penalty", -2.01),
                                          ("frequency_penalty", float("nan")), ("presence_penalty", float("inf")),
                                          ("frequency_penalty", "0.5"), ("presence_penalty", True)])
def test_out_of_range_penalties_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**{field: value})
    assert SamplingParams(frequency_penalty=-2, presence_penalty=2.0).penalised
    assert not SamplingParams().penalised
