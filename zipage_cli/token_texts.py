"""Each token's own piece of text, for the pictures that draw a request token by token (the console's
kept view, `zipage eval --trace`): joined, the pieces give the decoded text back."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# A character split over more tokens than this is given up on: its bytes show as replacement characters.
MAX_PENDING = 4


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """One string per id. A token that ends in the middle of a character gets "" and the token that
    completes it the whole character; special tokens keep their text ("<|im_start|>"), since what a
    request still holds is often one of them. Each token is decoded after a few earlier ones, as a
    streaming detokenizer does, so tokenizers that drop a leading space at the start of a decode keep it."""
    vocab = len(tokenizer)
    pieces: list[str] = []
    prefix, read = 0, 0  # ids[prefix:read] is text already given out, kept as context for the next piece

    def decode(part: list[int]) -> str:
        return tokenizer.decode([t for t in part if 0 <= t < vocab], skip_special_tokens=False)

    for i in range(len(ids)):
        before = decode(ids[prefix:read])
        after = decode(ids[prefix:i + 1])
        pending = i + 1 - read
        if len(after) > len(before) and (not after.endswith(REPLACEMENT_CHAR) or pending >= MAX_PENDING):
            pieces.append(after[len(before):])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    if read < len(ids) and ids:  # the text ends in an unfinished character
        pieces[-1] = decode(ids[prefix:])[len(decode(ids[prefix:read])):] or REPLACEMENT_CHAR
    return pieces
