"""Structured output: a JSON schema constrains what a request samples (docs/design-notes.md, "Structured
output"). The real SmolLM2 answers under schemas; tiny random models show the grammar holds whatever the
weights say, sampled or greedy, batched, overlapped, preempted and compressed; requests that do not ask
are untouched."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_pool_empty, greedy, tiny_llm
from zipage.engine import SamplingParams
from zipage.engine.execution.grammar_masks import mask_rows, unpack_on_device, unpack_on_host
from zipage.engine.loading.grammars import schema_of

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                     "maxItems": 3}}}
# Every value is a choice: a random model's output ends within a few dozen tokens.
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "celsius", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "celsius": {"type": "boolean"},
                          "days": {"enum": [1, 3, 7]}}}
WEATHER_VALUES = {"city": {"Paris", "Oslo", "Lima"}, "celsius": {True, False}, "days": {1, 3, 7}}


def assert_weather(text: str) -> None:
    value = json.loads(text)
    assert set(value) == set(WEATHER_VALUES)
    for key, allowed in WEATHER_VALUES.items():
        assert value[key] in allowed and type(value[key]) is type(next(iter(allowed)))


def assert_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "hobbies"}
    assert isinstance(value["name"], str) and type(value["age"]) is int
    assert isinstance(value["hobbies"], list) and len(value["hobbies"]) <= 3
    assert all(isinstance(h, str) for h in value["hobbies"])


# -- the masks ------------------------------------------------------------------------------------
def test_bitmasks_unpack_to_the_bits_they_hold_on_either_path():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 7), dtype=torch.int32, generator=gen)
    expected = torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(7 * 32)] for r in range(3)],
                            dtype=torch.bool)
    assert torch.equal(unpack_on_host(bitmask), expected)
    assert torch.equal(unpack_on_device(bitmask, torch.device("cpu")), expected)


def test_masked_rows_forbid_exactly_the_cleared_bits_and_leave_the_input_raw():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 70, generator=gen)  # wider than the grammar's 64 tokens
    raw = logits.clone()
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 2), dtype=torch.int32, generator=gen)
    out = mask_rows(logits, [3, 1], bitmask)
    assert torch.equal(logits, raw)
    for row, mask_row in ((3, 0), (1, 1)):
        allowed = unpack_on_host(bitmask)[mask_row]
        assert torch.equal(out[row, :64][allowed], raw[row, :64][allowed])
        assert torch.isneginf(out[row, :64][~allowed]).all() and torch.isneginf(out[row, 64:]).all()
    assert torch.equal(out[[0, 2]], raw[[0, 2]])


# -- what a request may ask -------------------------------------------------------------------------
@pytest.mark.parametrize("value", [False, 3, ["a"], 1.5])
def test_a_json_schema_of_the_wrong_kind_is_refused_by_name(value):
    with pytest.raises(ValueError, match="json_schema="):
        SamplingParams(json_schema=value)


def test_ignore_eos_cannot_run_past_the_end_of_the_json():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(json_schema=True, ignore_eos=True)


def test_a_schema_given_as_text_is_read_and_true_means_any_object():
    assert schema_of(json.dumps(WEATHER)) == WEATHER
    assert schema_of(True) == {"type": "object"}
    with pytest.raises(ValueError, match="not valid JSON"):
        schema_of("{not json")


@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    llm = tiny_llm(tiny_path)
    yield llm
    llm.close()


@pytest.mark.parametrize("schema, why", [({"type": "nonsense"}, "nonsense"),
                                         ({"type": "string", "pattern": "(unclosed"}, "unclosed"),
                                         ({"$ref": "#/missing"}, "missing")])
def test_a_schema_the_library_cannot_compile_is_a_value_error_and_nothing_runs(tiny_engine, schema, why):
    with pytest.raises(ValueError, match=f"json_schema=.*{why}"):
        tiny_engine.generate("hello", SamplingParams(json_schema=schema, max_tokens=4))
    assert_pool_empty(tiny_engine.engine)
    assert tiny_engine.generate("hello", greedy(3))[0].finish_reason == "length"  # still serving


# -- the grammar holds, whatever the weights --------------------------------------------------------
def test_greedy_and_sampled_outputs_of_a_random_model_match_the_schema(tiny_engine):
    params = [greedy(80, json_schema=WEATHER)] + [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=80, json_schema=WEATHER) for seed in range(6)]
    outs = tiny_engine.generate(["What is the weather?"] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert_weather(out.text)
    assert len({out.text for out in outs}) > 1  # sampling still chooses among what the grammar allows
    assert_pool_empty(tiny_engine.engine)


def test_requests_without_a_schema_are_untouched_by_those_beside_them(tiny_engine):
    prompts = ["The sky is", "Once upon a time", "Numbers: 1, 2,"]
    alone = [out.token_ids for out in tiny_engine.generate(prompts, greedy(24, ignore_eos=True))]
    mixed = tiny_engine.generate(prompts + ["Weather?"], [greedy(24, ignore_eos=True)] * 3 + [greedy(80, json_schema=WEATHER)])
    assert [out.token_ids for out in mixed[:3]] == alone
    assert_weather(mixed[3].text)


def test_any_json_object_parses(tiny_engine):
    out = tiny_engine.generate("{", SamplingParams(temperature=0.7, seed=3, max_tokens=400,
                                                   json_schema={"type": "object", "maxProperties": 2,
                                                                "additionalProperties": {"type": "boolean"}}))[0]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert isinstance(value, dict) and len(value) <= 2 and all(type(v) is bool for v in value.values())


def test_overlapped_steps_keep_overlapping_beside_a_grammar_and_give_the_same_outputs(tiny_path):
    """The grammar reads the tokens in flight only before sampling, so a batch with constrained requests
    still overlaps its steps, and every request gets what it gets with synchronous steps."""
    prompts = ["a", "bb", "ccc", "dddd"]
    params = [greedy(30, ignore_eos=True), greedy(60, json_schema=WEATHER), greedy(30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=60, json_schema=WEATHER)]
    runs = []
    for overlap in (False, True):
        llm = tiny_llm(tiny_path, overlap_steps=overlap)
        try:
            outs = llm.generate(prompts, params)
            runs.append([out.token_ids for out in outs])
            assert_weather(outs[1].text)
            assert_weather(outs[3].text)
            assert (llm.engine.overlapped_steps > 20) == overlap
            assert_pool_empty(llm.engine)
        finally:
            llm.close()
    assert runs[0] == runs[1]


def test_compressed_and_preempted_requests_keep_to_their_schema(tiny_path):
    """A pool too small for all of them at once: requests are compressed and preempted mid-answer."""
    llm = tiny_llm(tiny_path, compression=True, block_size=16, window=8, max_cache_blocks_per_seq=2,
                   num_kv_blocks=14)
    try:
        prompt = "Tell me the weather in a long sentence of many words, please. " * 2
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=80, json_schema=WEATHER) for seed in range(6)]
        outs = llm.generate([prompt] * 6, params)
        for out in outs:
            assert out.finish_reason == "stop", out.text
            assert_weather(out.text)
        totals = llm.engine.totals
        assert totals["compressions"] > 0 or totals["preemptions"] > 0
        assert_pool_empty(llm.engine)
    finally:
        llm.close()


# -- a real model --------------------------------------------------------------------------------------
def test_smollm2_answers_in_the_schema_it_was_given(smol):
    question = [{"role": "user", "content": "Describe a fictional person: name, age and hobbies, as JSON."}]
    out = smol.chat(question, greedy(120, json_schema=PERSON))
    assert out.finish_reason == "stop", out.text
    assert_person(out.text)
    free = smol.chat(question, greedy(40))
    assert not free.text.lstrip().startswith("{")  # left alone, it writes prose first: the grammar made the JSON


def test_logprobs_under_a_schema_stay_those_of_the_raw_distribution(smol):
    """Left alone, SmolLM2 opens this answer with prose (above); made to open a JSON object, the logprob
    it reports for that first "{" is still the raw distribution's, where "{" was not the favourite."""
    question = [{"role": "user", "content": "Describe a fictional person: name, age and hobbies, as JSON."}]
    out = smol.chat(question, SamplingParams(temperature=0, max_tokens=120, json_schema=PERSON, logprobs=3))
    assert_person(out.text)
    first = out.logprobs[0]
    assert out.token_ids[0] == first.token_id
    assert smol.engine.tokenizer.decode([first.token_id]).lstrip().startswith("{")
    assert first.rank > 1 and first.token_id not in list(first.top)[:1]
