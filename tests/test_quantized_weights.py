"""GGUF weights kept quantized on the CPU (docs/design-notes.md, "Quantized CPU weights"): the block
decoders against the gguf package's dequantization, PyTorch's int4 product against the dequantized
matmul, a tiny model written as a real GGUF file run quantized (integer dots, and int4 where they are
unavailable) against the same file dequantized, the fallback for a type no kernel runs, and the
refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from zipage.engine import EngineConfig, SamplingParams
from zipage.engine.core.engine_core import EngineCore
import zipage.engine.execution.models.quantized as quantized_module
from zipage.engine.execution.models.quantized import (Int4Weight, Kernels, NativeParts, NativeWeight, QuantizedEmbedding,
                                                      QuantizedWeights)
from zipage.engine.execution.models.quantized import INT4_MAX_ROWS, NATIVE_MAX_ROWS, pack_int4
from zipage.engine.execution.models.decoder import Linear
from zipage.engine.cpu_products import HalfWeight, half_product_works
from zipage.engine.loading.gguf_tensors import GroupedCodes, QuantizedTensor, read_gguf_tensors, tensor_index
from zipage.engine.loading.loader import ModelSource, _converted_dir, cpu_weight_forms
from zipage.engine.loading.model_registry import RANDOM_PRESETS
from zipage.testing import K_QUANT_BLOCKS, gguf_names, gguf_source, k_quant_blocks, write_gguf


def quantized(values: np.ndarray, qtype: str) -> QuantizedTensor:
    """`values` [rows, cols] float32 quantized by the gguf package (K-quant blocks are random: the
    package cannot quantize to them)."""
    rows, cols = values.shape
    if qtype in K_QUANT_BLOCKS:
        return QuantizedTensor(qtype, (rows, cols), k_quant_blocks(qtype, rows, cols, np.random.default_rng(rows * cols)))
    return QuantizedTensor(qtype, (rows, cols), quants.quantize(values, GGMLQuantizationType[qtype]))


needs_fbgemm = pytest.mark.skipif(not half_product_works(), reason="this torch has no FBGEMM float16 product")
HALF_LOGPROB_TOLERANCE = 1e-2


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q6_K"])
def test_the_group_decoders_give_exactly_what_the_gguf_package_dequantizes(qtype):
    tensor = quantized(weights(48, 512, seed=1), qtype)
    want = quants.dequantize(tensor.blocks, GGMLQuantizationType[qtype])
    assert torch.equal(tensor.groups().dequantize(), torch.from_numpy(want))
    assert torch.equal(tensor.dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_the_int4_product_equals_the_dequantized_matmul(qtype, tokens):
    tensor = quantized(weights(80, 512, seed=2), qtype)
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(3))
    want = x @ tensor.dequantize().T
    got = Int4Weight(*pack_int4(tensor.groups()))(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # bf16 activations, scales and outputs: well under 1% of the product's size
    assert (got - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_quantized_embedding_looks_up_the_exact_dequantized_rows(qtype):
    tensor = quantized(weights(64, 256 if qtype == "Q6_K" else 96, seed=4), qtype)
    ids = torch.tensor([5, 0, 63, 5])
    assert torch.equal(QuantizedEmbedding(tensor.groups(), torch.float32)(ids), tensor.dequantize()[ids])


def test_llama_q_and_k_rows_are_put_back_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = RANDOM_PRESETS["llama-tiny"].make_config()
    values = weights(config.num_key_value_heads * 16, 64, seed=5)
    processor = LlamaTensorProcessor(config={"num_attention_heads": config.num_attention_heads,
                                             "num_key_value_heads": config.num_key_value_heads})
    want = processor.process(values, "blk.0.attn_k.weight").weights
    path = write_gguf(config, "Q8_0", seed=0, only={"blk.0.attn_k.weight": values})
    got = dict(read_gguf_tensors(path, config))["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(got.blocks, quants.quantize(np.ascontiguousarray(want), GGMLQuantizationType.Q8_0))


# ------------------------------------------------------------------------------------------
# A tiny model as a real GGUF file


@pytest.fixture(scope="session")
def _native_build(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("native")


@pytest.fixture(autouse=True)
def _cache_of_their_own(tmp_path, monkeypatch, _native_build):
    """The quantized forms are cached beside a GGUF's converted copy: these files' go to a temp cache,
    whose native kernels are built once for all the tests."""
    cache = tmp_path / "zipage-cache"
    cache.mkdir()
    (cache / "native").symlink_to(_native_build, target_is_directory=True)
    monkeypatch.setenv("ZIPAGE_CACHE", str(cache))


def without_native(monkeypatch) -> None:
    """As on a machine without a C compiler."""
    monkeypatch.setattr(quantized_module, "native_kernel", lambda: (None, "no C compiler: 'cc' is not on PATH"))


def engine(source: ModelSource, weight_dtype: str, **knobs) -> EngineCore:
    return EngineCore(EngineConfig(model=source.path, device="cpu", compression=False, block_size=16,
                                   num_kv_blocks=64, weight_dtype=weight_dtype, **knobs), source)


def finished(core: EngineCore, prompt: list[int], params: SamplingParams):
    core.add_request(prompt, params)
    outs = []
    while core.has_work():
        outs += [o for o in core.step() if o.finished]
    return outs[0]


def prompt_logprobs(core: EngineCore, prompt: list[int]) -> list:
    """Each prompt token's TokenLogprobs (with the top-1) after the first, teacher-forced."""
    return finished(core, prompt, SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1)).prompt_logprobs[1:]


def assert_decode_follows_float32(quant: EngineCore, plain: EngineCore, prompt: list[int]) -> None:
    """12 greedy decode steps of `quant`, each token's log-probability within 0.1 nats of what the
    float32 model `plain` gives it, teacher-forced (integer dots: int16 activations, float16 scales)."""
    out = finished(quant, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
    judged = prompt_logprobs(plain, prompt + out.token_ids)[-len(out.token_ids):]
    assert [t.logprob for t in out.logprobs] == pytest.approx([r.logprob for r in judged], abs=0.1)


@needs_fbgemm
@pytest.mark.parametrize("family,qtype,embedding,native", [
    ("llama-tiny", "Q4_1", "Q8_0", True), ("qwen3-tiny", "Q4_0", "Q4_0", True),
    ("llama-tiny", "Q4_1", "Q8_0", False), ("qwen3-tiny", "Q4_0", "Q4_0", False)])
def test_a_tiny_gguf_runs_quantized_and_agrees_with_its_dequantized_self(family, qtype, embedding, native, capsys,
                                                                         monkeypatch):
    if not native:
        without_native(monkeypatch)
    short, limit = (NativeWeight, NATIVE_MAX_ROWS) if native else (Int4Weight, INT4_MAX_ROWS)
    rows_seen, copy_rows = [], []
    for form, seen in ((short, rows_seen), (HalfWeight, copy_rows)):
        monkeypatch.setattr(form, "forward", lambda self, x, f=form.forward, s=seen: s.append(x.shape[0]) or f(self, x))
    config = RANDOM_PRESETS[family].make_config()
    source = gguf_source(config, write_gguf(config, qtype, seed=7, embedding=embedding))
    quant, plain = engine(source, "auto"), engine(source, "float32")
    report = quant.runner.model.weight_report.forms
    tied = config.tie_word_embeddings
    name = "integer dots" if native else "int4"
    assert report[f"{qtype} -> {name} / float16"] == 4 * config.num_hidden_layers + (0 if tied else 1)  # + an untied head
    assert report[f"{embedding} -> embedding rows"] == 1
    # A Q8_0 head has integer dots only: without them it runs on its float16 copy.
    head = name if native or embedding != "Q8_0" else None
    assert report[f"{embedding} -> {head} / float16 LM head"] == (1 if tied and head else 0)
    assert plain.runner.model.weight_report.forms == {}  # float32: nothing kept quantized
    err = capsys.readouterr().err
    if native:
        assert err == ""  # nothing fell back
    else:  # said why, once per stored type
        missed = " and ".join(sorted({qtype, embedding}))
        assert err == (f"zipage: integer dots are unavailable: no C compiler: 'cc' is not on PATH; so {missed} "
                       "weights run on slower kernels\n")
    # The copies replace the float32 values: no layer keeps its float32 weight (nor a tied head), and
    # the memory counted holds each copied value in 2 bytes.
    model = quant.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight is None and m.packed is None and m.quant.copy is not None for m in layers)
    assert all(isinstance(m.quant.short, short) for m in layers)
    # with integer dots the norms run in the same native library; without, through torch
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all((m.native is not None) == native for m in norms)
    copied = sum(m.in_features * m.out_features for m in layers) + (config.vocab_size * config.hidden_size if tied else 0)
    assert sum(m.nbytes for m in model.modules() if isinstance(m, HalfWeight)) == 2 * copied
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert quant.runner.weight_bytes == held + 2 * copied
    assert model.head_weight is None and model._packed_head is None
    gen = torch.Generator().manual_seed(8)
    agree = total = 0
    for _ in range(4):
        # Decode steps of one row take the short form; the prompt's prefill, the float copy.
        prompt = torch.randint(0, 256, (20,), generator=gen).tolist()
        out = finished(quant, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0))
        judged = prompt_logprobs(plain, prompt + out.token_ids)[-len(out.token_ids):]
        for token, mine, ref in zip(out.token_ids, out.logprobs, judged):
            # int16 or bf16 activations: within 0.1 nats of the float32 model's own log-probability
            assert mine.logprob == pytest.approx(ref.logprob, abs=0.1)
            agree += next(iter(ref.top)) == token
            total += 1
    assert agree / total >= 0.9
    # decode steps ran the short form; the 20-token prefills, past its row limit, ran the copies
    assert 1 in rows_seen and max(rows_seen) <= limit < 20
    assert 20 in copy_rows and min(copy_rows) > limit


@pytest.mark.parametrize("qtype,bits", [("Q4_K", 4), ("Q6_K", 6)])
def test_k_quants_take_integer_dots_on_their_scales_rounded_to_float16(qtype, bits):
    tensor = quantized(weights(64, 512, seed=11), qtype)
    forms = QuantizedWeights.forms({"w": ("native", {None: tensor})})
    native = NativeWeight(Kernels.here().native, forms["w.blocks"], bits)
    groups = tensor.groups()
    rounded = GroupedCodes(groups.codes, groups.scale.half().float(), groups.low.half().float())
    assert not torch.equal(rounded.scale, groups.scale)  # d times an integer sub-scale: no float16 values
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(12))
    got = native(x).double()
    for values, tolerance in ((rounded.dequantize(), 2e-4), (tensor.dequantize(), 2e-3)):
        want = x.double() @ values.double().T
        # int16 activations: within ~1e-4 of the rounded weights' product, and float16 scales within
        # 2**-11 of the file's
        assert (got - want).norm() / want.norm() < tolerance


@needs_fbgemm
def test_a_q4_k_m_mix_of_q5_0_and_q8_0_runs_fused_on_integer_dots(capsys):
    """llama.cpp's Q4_K_M files keep most tensors of a model whose widths are no multiple of 256 in
    Q5_0 and attn_v in Q8_0: the fused q/k/v runs on integer dots, every code an 8-bit one, and every
    layer in one native call."""
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    layers = config.num_hidden_layers
    mixed = {f"blk.{i}.attn_v.weight": "Q8_0" for i in range(layers)}
    source = gguf_source(config, write_gguf(config, "Q5_0", seed=12, types=mixed))
    quant, plain = engine(source, "auto"), engine(source, "float32")
    forms = quant.runner.model.weight_report.forms
    assert forms["Q5_0+Q8_0 -> integer dots / float16"] == layers
    assert forms["Q5_0 -> integer dots / float16"] == 3 * layers + (0 if config.tie_word_embeddings else 1)
    assert capsys.readouterr().err == ""  # nothing fell back
    assert all(layer.native is not None for layer in quant.runner.model.model.layers)
    gen = torch.Generator().manual_seed(13)
    for _ in range(2):
        assert_decode_follows_float32(quant, plain, torch.randint(0, 256, (12,), generator=gen).tolist())


def config_of_k_quant_widths():
    """llama-tiny with widths that are multiples of 256, as the K-quants' super-blocks need."""
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    config.hidden_size, config.intermediate_size = 256, 512
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


@needs_fbgemm
def test_q6_k_layers_run_in_one_native_call_beside_q5_0(capsys):
    """A model whose widths are multiples of 256, its ffn_down in Q6_K (layout 6: a scale per 16
    values) and the rest in Q5_0: every layer is one native call and agrees with the float32 model."""
    config = config_of_k_quant_widths()
    layers = config.num_hidden_layers
    downs = {f"blk.{i}.ffn_down.weight": "Q6_K" for i in range(layers)}
    source = gguf_source(config, write_gguf(config, "Q5_0", seed=14, types=downs))
    quant, plain = engine(source, "auto"), engine(source, "float32")
    forms = quant.runner.model.weight_report.forms
    assert forms["Q6_K -> integer dots / float16"] == layers and capsys.readouterr().err == ""
    model = quant.runner.model.model
    assert all(layer.native is not None and layer.mlp.down_proj.quant.short.weight.bits == 6 for layer in model.layers)
    assert_decode_follows_float32(quant, plain, list(range(5, 17)))


@needs_fbgemm
def test_fused_parts_of_different_layouts_run_a_product_for_each_layout(capsys):
    """llama.cpp's Q4_K_M mix where widths are multiples of 256: Q4_K q and k beside a Q6_K v. The
    fused q/k/v runs in integer dots (not on its float16 copy): q and k as one product, v as another."""
    config = config_of_k_quant_widths()
    layers = config.num_hidden_layers
    v_and_down = {f"blk.{i}.{name}.weight": "Q6_K" for i in range(layers) for name in ("attn_v", "ffn_down")}
    source = gguf_source(config, write_gguf(config, "Q4_K", seed=15, types=v_and_down))
    quant, plain = engine(source, "auto"), engine(source, "float32")
    forms = quant.runner.model.weight_report.forms
    assert forms["Q4_K+Q6_K -> integer dots / float16"] == layers and forms["Q6_K -> integer dots / float16"] == layers
    assert capsys.readouterr().err == ""
    for layer in quant.runner.model.model.layers:
        parts = layer.self_attn.qkv_proj.quant.short
        assert isinstance(parts, NativeParts) and [p.weight.bits for p in parts.parts] == [4, 6]
        q_and_k = (config.num_attention_heads + config.num_key_value_heads) * config.head_dim
        assert [p.weight.shape[0] for p in parts.parts] == [q_and_k, config.num_key_value_heads * config.head_dim]
        assert layer.native is None  # one native call a layer takes one product a projection
    assert_decode_follows_float32(quant, plain, list(range(3, 15)))


@needs_fbgemm
def test_a_type_no_kernel_runs_on_its_float16_copy_and_said_so(capsys):
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    source = gguf_source(config, write_gguf(config, "Q5_1", seed=9))
    core = engine(source, "auto")
    assert core.runner.model.weight_report.forms["Q5_1 -> float16"] == 4 * config.num_hidden_layers + 1
    assert "Q5_1 weights run as float16 on the CPU: no CPU kernel for Q5_1 blocks" in capsys.readouterr().err
    prompt = list(range(30))
    mine, ref = prompt_logprobs(core, prompt), prompt_logprobs(engine(source, "float32"), prompt)
    # float16 holds Q5_1's values within 2**-11 of themselves
    assert [a.logprob for a in mine] == pytest.approx([b.logprob for b in ref], abs=HALF_LOGPROB_TOLERANCE)


@pytest.mark.parametrize("family,qtype,kv_cache_dtype", [("llama-tiny", "Q4_1", "auto"), ("qwen2-tiny", "Q8_0", "auto"),
                                                          ("llama-tiny", "Q4_1", "fp8"), ("llama-tiny", "Q4_1", "int8")])
def test_a_decode_layer_in_one_native_call_gives_the_operator_paths_bits(family, qtype, kv_cache_dtype, monkeypatch):
    from zipage.engine.execution.models.native_layer import NativeDecodeLayer

    calls = []
    monkeypatch.setattr(NativeDecodeLayer, "__call__",
                        lambda self, *a, f=NativeDecodeLayer.__call__: calls.append(a[0].shape[0]) or f(self, *a))
    config = RANDOM_PRESETS[family].make_config()  # qwen2: q/k/v biases, added in the native layer too
    source = gguf_source(config, write_gguf(config, qtype, seed=17))
    whole, by_operator = (engine(source, "auto", kv_cache_dtype=kv_cache_dtype) for _ in range(2))
    layers = whole.runner.model.model.layers
    assert all(layer.native is not None for layer in layers)
    for layer in by_operator.runner.model.model.layers:
        layer.native = None
    gen = torch.Generator().manual_seed(18)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 23, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for core in (whole, by_operator):
        for prompt in prompts:
            core.add_request(prompt, params)
    outs = []
    for core in (whole, by_operator):
        done = []
        while core.has_work():
            done += [o for o in core.step() if o.finished]
        outs.append(sorted(done, key=lambda o: o.id))
    for mine, theirs in zip(*outs):
        assert mine.token_ids == theirs.token_ids
        assert [p.logprob for p in mine.logprobs] == [p.logprob for p in theirs.logprobs]  # the same bits
    # three streams decode together (and alone once the others finish): every layer ran as one call
    assert calls and max(calls) == 3 and len(calls) % len(layers) == 0


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_an_8bit_cache_runs_natively_as_the_reference_path_runs_it(kv_cache_dtype, monkeypatch):
    """A quantized model's steps over an 8-bit cache take the native kernels (the codes written and read
    there, every decode layer one call), and follow what the PyTorch path gives on the same weights:
    each greedy token's log-probability within 0.01 nats (the two round a few values on either side of
    a code's midpoint), over a prompt longer than a block and twelve decode steps."""
    from zipage.engine.execution.models.native_layer import NativeDecodeLayer

    calls = []
    monkeypatch.setattr(NativeDecodeLayer, "__call__",
                        lambda self, *a, f=NativeDecodeLayer.__call__: calls.append(a[0].shape[0]) or f(self, *a))
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    source = gguf_source(config, write_gguf(config, "Q8_0", seed=19))
    native = engine(source, "auto", kv_cache_dtype=kv_cache_dtype)
    assert native.runner.kv_cache.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    prompt = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(20)).tolist()
    tokens, logprobs = greedy_run(native, prompt)
    assert calls and len(calls) % len(native.runner.model.model.layers) == 0
    layer = native.runner.model.model.layers[0].self_attn
    assert layer.runs_natively(torch.zeros(1)) and layer.cache_scales
    without_native(monkeypatch)
    plain = engine(source, "auto", kv_cache_dtype=kv_cache_dtype)
    assert plain.runner.model.model.layers[0].self_attn.native is None
    judged = prompt_logprobs(plain, prompt + tokens)[-len(tokens):]
    assert logprobs == pytest.approx([r.logprob for r in judged], abs=0.01)


def greedy_run(core: EngineCore, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = finished(core, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
    return out.token_ids, [p.logprob for p in out.logprobs]


def forms_cache(source: ModelSource) -> Path:
    (file,) = _converted_dir(Path(source.path)).glob("forms-*.safetensors")
    return file


def test_the_quantized_forms_are_cached_and_run_exactly_as_freshly_packed(monkeypatch):
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    source = gguf_source(config, write_gguf(config, "Q4_1", seed=12))
    prompt = list(range(40, 60))  # its prefill runs the float copies, its decode steps the quantized forms
    fresh = engine(source, "auto")
    want, report = greedy_run(fresh, prompt), fresh.runner.model.weight_report.forms
    assert forms_cache(source).stat().st_size > 0

    def no_decoding(planned):
        raise AssertionError("the quantized forms were decoded again instead of read from the cache")

    monkeypatch.setattr(QuantizedWeights, "forms", staticmethod(no_decoding))
    cached = engine(source, "auto")
    assert cached.runner.model.weight_report.forms == report
    assert greedy_run(cached, prompt) == want  # same tokens, same log-probabilities


def test_a_damaged_cache_of_quantized_forms_is_rebuilt(monkeypatch):
    config = RANDOM_PRESETS["qwen3-tiny"].make_config()
    source = gguf_source(config, write_gguf(config, "Q4_0", seed=13, embedding="Q4_0"))
    prompt = list(range(10, 30))
    want = greedy_run(engine(source, "auto"), prompt)
    file = forms_cache(source)
    whole = file.read_bytes()
    builds = []
    forms = QuantizedWeights.forms
    monkeypatch.setattr(QuantizedWeights, "forms", staticmethod(lambda planned: builds.append(1) or forms(planned)))
    for damage in (whole[:len(whole) // 2], b"", b"not safetensors at all"):
        file.write_bytes(damage)  # a cut file, an empty one, garbage
        assert greedy_run(engine(source, "auto"), prompt) == want
        assert file.read_bytes() == whole  # written again, whole
    assert len(builds) == 3


@needs_fbgemm
def test_the_listing_says_what_a_gguf_runs_as(monkeypatch):
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    forms = cpu_weight_forms(write_gguf(config, "Q4_1", seed=10))
    assert "Q4_1 x15 integer dots / float16" in forms and "Q8_0 x1 integer dots / float16" in forms
    monkeypatch.setenv("CC", "no-such-compiler")  # without a compiler: PyTorch's int4, Q8_0 on its copy
    forms = cpu_weight_forms(write_gguf(config, "Q4_1", seed=10))
    assert "Q4_1 x15 int4 / float16" in forms and "Q8_0 x1 float16" in forms


def test_a_truncated_gguf_is_a_clear_error(tmp_path):
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    data = open(write_gguf(config, "Q4_0", seed=11), "rb").read()
    for cut in (10, 200, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="GGUF"):
            tensor_index(bad)


@pytest.mark.parametrize("knobs,message", [
    (dict(weight_dtype="int4"), "weight_dtype='int4': must be one of auto, float32, bfloat16"),
    (dict(weight_dtype="float32", dtype="bfloat16"), "disagrees with dtype='bfloat16'"),
])
def test_the_weight_dtype_knob_refuses_what_it_cannot_do(knobs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**knobs)


@needs_fbgemm
@pytest.mark.parametrize("tokens", [0, 1, 5, 37])
def test_the_float16_copy_computes_in_float32_from_float16_rounded_weights(tokens):
    gen = torch.Generator().manual_seed(14)
    weight = torch.randn(96, 160, generator=gen) * 0.05
    x = torch.randn(tokens, 160, generator=gen)
    got = HalfWeight(weight)(x)
    want = x @ weight.half().float().T
    assert got.dtype == torch.float32 and got.shape == (tokens, 96)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert HalfWeight(weight)(x.bfloat16()).dtype == torch.bfloat16  # the caller's dtype back
    assert HalfWeight(weight).nbytes == 96 * 160 * 2


def test_without_fbgemm_the_copies_stay_float32_and_it_is_said(capsys, monkeypatch):
    import zipage.engine.execution.models.quantized as quantized_module

    monkeypatch.setattr(quantized_module, "half_product_works", lambda: False)
    config = RANDOM_PRESETS["qwen3-tiny"].make_config()
    source = gguf_source(config, write_gguf(config, "Q4_0", seed=15, embedding="Q4_0"))
    core = engine(source, "auto")
    forms = core.runner.model.weight_report.forms
    assert forms["Q4_0 -> integer dots / float32"] == 4 * config.num_hidden_layers
    assert forms["Q4_0 -> integer dots / float32 LM head"] == 1
    assert "no FBGEMM float16 product, so longer products run on float32 copies" in capsys.readouterr().err
    assert not any(isinstance(m, HalfWeight) for m in core.runner.model.modules())
    # A prefill runs the float32 copies: what the dequantized model computes, but for the float rounding
    # of the native norms.
    prompt = list(range(5, 35))
    mine, ref = prompt_logprobs(core, prompt), prompt_logprobs(engine(source, "float32"), prompt)
    assert [a.logprob for a in mine] == pytest.approx([b.logprob for b in ref], abs=1e-4)


@needs_fbgemm
def test_a_weight_beyond_float16s_range_keeps_its_float32_values(capsys):
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    names = gguf_names(config)
    rng = np.random.default_rng(16)
    tensors = {name: (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32) if isinstance(shape, int)
               else (rng.standard_normal(shape) * 0.15).astype(np.float32) for name, shape in names.items()}
    tensors["blk.0.ffn_down.weight"][0, :32] = 1e5  # past float16's 65504
    source = gguf_source(config, write_gguf(config, "Q8_0", seed=16, only=tensors))
    core = engine(source, "auto")
    down = core.runner.model.model.layers[0].mlp.down_proj
    # integer dots for short products (its scales are float16 values), its float32 values, oneDNN-packed,
    # for the rest
    assert down.quant.copy is None and isinstance(down.quant.short, NativeWeight) and down.packed is not None
    forms = core.runner.model.weight_report.forms
    assert forms["Q8_0 -> integer dots / float32"] == 1  # the rest of a Q8_0 file has float16 copies
    assert forms["Q8_0 -> integer dots / float16"] == 4 * config.num_hidden_layers + 1 - 1  # + the untied head, - down
    assert "values beyond float16's range" in capsys.readouterr().err
    prompt = list(range(20))
    mine, ref = prompt_logprobs(core, prompt), prompt_logprobs(engine(source, "float32"), prompt)
    assert [a.logprob for a in mine] == pytest.approx([b.logprob for b in ref], abs=HALF_LOGPROB_TOLERANCE)


@needs_fbgemm
def test_a_decode_steps_tokens_do_not_depend_on_how_many_requests_run_beside_it():
    # Up to LAYER_MAX_ROWS decode rows, the layers and the (tied, Q8_0) LM head all take integer dots,
    # so a request's log-probabilities are the same bits alone as beside five others (six rows: past
    # NATIVE_MAX_ROWS, where a lone product would take its float16 copy). Products of `float_min_rows`
    # rows or more are float ones (AVX-512: 4; AVX2: 8): there the bits agree within 1-3 and 4-8 requests.
    config = RANDOM_PRESETS["llama-tiny"].make_config()
    source = gguf_source(config, write_gguf(config, "Q4_1", seed=21, embedding="Q8_0"))
    gen = torch.Generator().manual_seed(22)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (11, 17, 8, 25, 13, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)

    def run(count: int) -> tuple:
        core = EngineCore(EngineConfig(model=source.path, device="cpu", compression=False, block_size=16,
                                       num_kv_blocks=64, weight_dtype="auto", mixed_steps=False), source)
        for prompt in prompts[:count]:
            core.add_request(prompt, params)
        done = []
        while core.has_work():
            done += [o for o in core.step() if o.finished]
        first = min(done, key=lambda o: o.id)  # the first prompt's request
        return first.token_ids, [(p.logprob, p.top) for p in first.logprobs]

    alone, beside_one, beside_three, beside_five = run(1), run(2), run(4), run(6)
    assert alone == beside_one and beside_three == beside_five
    if (quantized_module.native_kernel()[0].float_min_rows or 8) > 6:  # one kind of product for 1-6 rows
        assert alone == beside_five
