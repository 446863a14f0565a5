"""Bad input raises a clear ValueError naming the problem, and the engine keeps serving."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import BASE_KNOBS, assert_pool_empty, greedy, random_prompts, tiny_llm
from zipage.engine import LLM, EngineConfig, SamplingParams

GOOD_PROMPT = random_prompts(1, [12], seed=81)[0]
GOOD_PARAMS = greedy(10, ignore_eos=True)


def make_llm(path):
    llm = tiny_llm(path, max_model_len=64, num_kv_blocks=32)
    llm.expected = llm.generate([GOOD_PROMPT], GOOD_PARAMS)[0].token_ids
    return llm


@pytest.fixture(scope="module")
def shared_llm(tiny_path):
    return make_llm(tiny_path)


@pytest.fixture
def llm(shared_llm):
    yield shared_llm
    for request_id in list(shared_llm.engine.requests):  # one failure must not cascade
        shared_llm.engine.abort(request_id)


def still_serves(llm):
    """No request left behind, every block free, and a good request gets its usual tokens."""
    assert not llm.engine.has_work(), f"leftover requests: {llm.engine.requests}"
    assert_pool_empty(llm.engine)
    out = llm.generate([GOOD_PROMPT], GOOD_PARAMS)[0]
    assert out.token_ids == llm.expected and out.finish_reason == "length"
    assert_pool_empty(llm.engine)


BAD_PROMPTS = [
    pytest.param("", "empty", id="empty-str"),
    pytest.param([[]], "empty", id="empty-ids"),
    pytest.param(b"\xff\xfe\xfd", "UTF-8", id="non-utf8-bytes"),
    pytest.param("\ud800 lone surrogate", "UTF-8", id="lone-surrogate"),
    pytest.param([[1, 2, 512]], "out of range", id="id-equal-to-vocab"),
    pytest.param([[1, -1]], "out of range", id="negative-id"),
    pytest.param([[3] * 64], "max_model_len", id="64-ids-max_model_len-64"),
    pytest.param("x" * 100, "max_model_len", id="long-text"),
    pytest.param([3.5], "prompt", id="float"),
    pytest.param([[5, True, 7]], "integers", id="bool-id"),
]
CORE_BAD_PROMPTS = [p for p in BAD_PROMPTS if p.id != "float"]


@pytest.mark.parametrize("prompt,words", BAD_PROMPTS)
def test_bad_prompt_raises_value_error_and_engine_still_serves(llm, prompt, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(prompt, GOOD_PARAMS)
    still_serves(llm)


@pytest.mark.parametrize("prompt,words", CORE_BAD_PROMPTS)
def test_bad_prompt_rejected_by_engine_core(llm, prompt, words):
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    with pytest.raises(ValueError, match=words):
        llm.engine.add_request(prompt, GOOD_PARAMS)
    still_serves(llm)


@pytest.mark.parametrize("bad", [[7] * 80, "", [1, 999]], ids=["too-long", "empty", "bad-id"])
def test_bad_prompt_in_a_batch_runs_nothing(tiny_path, bad):
    """generate() checks every prompt before running any: a bad later prompt must not leave the
    good earlier ones queued in the engine (they would run, unseen, inside the next call)."""
    llm = make_llm(tiny_path)
    for _ in range(2):
        with pytest.raises(ValueError):
            llm.generate([GOOD_PROMPT, [4, 5, 6], bad], GOOD_PARAMS)
        assert not llm.engine.requests, f"prompts before the bad one were left queued: {llm.engine.requests}"
        still_serves(llm)


@pytest.mark.parametrize("ids", [[1, 2.5, 3], [1, "7", 3], [1, True, 3], torch.tensor([1, 0], dtype=torch.bool)],
                         ids=["float", "str", "bool", "bool-tensor"])
def test_token_ids_must_be_integers(llm, ids):
    """A token id list holding non-integers is rejected, not silently truncated or coerced
    (2.5 -> 2, "7" -> 7, True -> 1)."""
    with pytest.raises(ValueError, match="token id|integer"):
        llm.engine.add_request(ids, GOOD_PARAMS)
    still_serves(llm)


def test_prompt_that_fills_max_model_len_gets_length(llm):
    """63 prompt tokens with max_model_len 64: exactly one token, finish_reason "length"."""
    out = llm.generate([[9] * 63], greedy(50, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    out = llm.generate([[9] * 60], greedy(50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    still_serves(llm)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(seed="x"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos="false"), "ignore_eos"),  # a non-empty string is truthy: EOS would be ignored
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(stop_strings_in_output="yes"), "stop_strings_in_output"),
])
def test_bad_sampling_params(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    # A params object broken after construction is caught when the request is added.
    params = SamplingParams(max_tokens=4)
    for key, value in kwargs.items():
        setattr(params, key, value)
    with pytest.raises(ValueError, match=field):
        llm.generate([GOOD_PROMPT], params)
    still_serves(llm)


def test_params_must_be_sampling_params(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([GOOD_PROMPT], {"temperature": 0})
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([GOOD_PROMPT], [GOOD_PARAMS, GOOD_PARAMS])
    still_serves(llm)


def test_unknown_config_field(tiny_path):
    with pytest.raises(ValueError, match="bogus"):
        LLM(tiny_path, bogus=1, **BASE_KNOBS)
    with pytest.raises(ValueError, match="bogus"):
        EngineConfig.from_kwargs(tiny_path, bogus=1)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=24), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(device="tpu"), "device"),
    (dict(dtype="int8"), "dtype"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(prefix_caching="yes"), "prefix_caching"),
    (dict(max_model_len=10 ** 6), "max_model_len"),
    (dict(recent_share=1.0), "recent_share"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(global_decay=None), "global_decay"),
    (dict(recent_share="0.5"), "recent_share"),
    (dict(memory_utilization=True), "memory_utilization"),
    (dict(redundancy_temperature=float("inf")), "redundancy_temperature"),
    (dict(num_sink_tokens=True), "num_sink_tokens"),
    (dict(seed=2 ** 70), "seed"),
    (dict(seed=True), "seed"),
])
def test_invalid_config_values_name_the_field(tiny_path, kwargs, field):
    knobs = dict(BASE_KNOBS)
    knobs.update(kwargs)
    with pytest.raises(ValueError, match=field):
        LLM(tiny_path, **knobs)


@pytest.mark.parametrize("model", ["/nonexistent/zipage/model-dir", "/nonexistent/model.gguf",
                                   "random:no-such-preset"])
def test_missing_model_path(model):
    with pytest.raises(ValueError, match="not found|unknown"):
        LLM(model, **BASE_KNOBS)


def test_prompt_larger_than_kv_pool(tiny_path):
    llm = tiny_llm(tiny_path, num_kv_blocks=2)  # 32 tokens of KV
    with pytest.raises(ValueError, match="KV pool"):
        llm.generate([[5] * 40], GOOD_PARAMS)
    out = llm.generate([[5] * 20], greedy(5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    assert_pool_empty(llm.engine)


def test_chat_with_bad_messages(llm):
    for bad in ([[]], [{"content": "no role"}], ["just a string"], [{"role": "user"}],
                [{"role": "user", "content": None}], [{"role": "user", "content": 5}],
                [{"role": ["user"], "content": "hi"}]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, GOOD_PARAMS)
    still_serves(llm)


def test_chat_template_that_refuses_the_messages_is_a_value_error(tiny_path, tmp_path):
    """Many real templates raise on messages they do not accept (roles out of order): that is the
    caller's input, so a ValueError naming the model, not a Jinja exception."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_path, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
        "{{ raise_exception('the first message must be from the user') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    llm = tiny_llm(str(folder), num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match="chat template .* refused .*first message must be from the user"):
            llm.chat([{"role": "assistant", "content": "hi"}], GOOD_PARAMS)
        assert len(llm.chat([{"role": "user", "content": "hi"}], greedy(3, ignore_eos=True)).token_ids) == 3
        assert_pool_empty(llm.engine)
    finally:
        llm.close()


def test_kv_pool_larger_than_memory_is_a_value_error(tiny_path):
    """A num_kv_blocks no machine can hold (petabytes) says so instead of an allocator error."""
    with pytest.raises(ValueError, match="KV pool .* does not fit .*num_kv_blocks"):
        LLM(tiny_path, num_kv_blocks=10 ** 14, **BASE_KNOBS)
