"""Streaming text from token ids: characters split across tokens and stop strings."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_characters_and_stop_strings_stream_as_the_tokenizer_decodes(data):
    """Accents, CJK and emoji split across byte tokens, ids added a few at a time, a stop string
    somewhere in the text: the streamed deltas join into the tokenizer's decode of the ids, cut
    before the first stop string (the finished text the engine reports)."""
    from zipage.engine.loading.detokenizer import IncrementalDetokenizer
    from zipage.engine.loading.loader import resolve_model

    tok = resolve_model("random:qwen3-0.6b").tokenizer
    words = ["naïve", " café", " ☕", " 東京", " 🐈‍⬛", " Żółć", " é", " ü", "\n", " plain", " 한국어", " 4721"]
    text = "".join(data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=12)))
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level pieces: split one multi-byte character into its byte tokens.
    if data.draw(st.booleans()):
        raw = list(data.draw(st.sampled_from(["€", "東", "🐈"])).encode())
        at = data.draw(st.integers(0, len(ids)))
        ids[at:at] = _byte_ids(tok, raw)
    full = tok.decode(ids)
    stop = []
    if data.draw(st.booleans()) and len(full) > 2:
        a = data.draw(st.integers(0, len(full) - 2))
        stop = [full[a:a + data.draw(st.integers(1, min(4, len(full) - a)))]]
    detok = IncrementalDetokenizer(tok, stop=stop)
    streamed, i = "", 0
    while i < len(ids):
        step = data.draw(st.integers(1, 3))
        streamed += detok.add(ids[i:i + step])
        i += step
    streamed += detok.finish()
    assert streamed == (full[:full.find(stop[0])] if stop else full)


def _byte_ids(tok, raw: list[int]) -> list[int]:
    """The byte-level BPE tokens of single bytes: GPT-2's table maps each byte to one printable
    character, and the vocabulary holds each as a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    ids = tok.convert_tokens_to_ids([table[b] for b in raw])
    assert tok.decode(ids) == bytes(raw).decode()
    return ids
