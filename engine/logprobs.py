"""What a request's log-probabilities look like: one `TokenLogprobs` per token, for the tokens it
generated (`SamplingParams.logprobs`) and for its prompt (`SamplingParams.prompt_logprobs`).
docs/design-notes.md, "Log-probabilities", says how they are computed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """One token at its position, under the model's raw distribution there (log_softmax of the float32
    logits, before penalties, temperature and the sampling filters)."""

    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens are more likely: 1 for the most likely (a greedy token)
    top: dict[int, float]  # the k most likely token ids and their logprobs, most likely first (k as asked)

    def to_dict(self) -> dict:
        """As JSON has it: `top` as [token id, logprob] pairs, most likely first (JSON keys are strings)."""
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top": [[token_id, logprob] for token_id, logprob in self.top.items()]}

    @classmethod
    def from_dict(cls, data: dict) -> "TokenLogprobs":
        return cls(int(data["token_id"]), float(data["logprob"]), int(data["rank"]),
                   {int(token_id): float(logprob) for token_id, logprob in data["top"]})
