"""Offline API: LLM(model, **knobs).generate(prompts, params)."""

from __future__ import annotations

from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.core import EngineCore, RequestOutput
from zipage.engine.events import EngineSnapshot

STALL_STEPS = 10_000  # steps without a forward pass or an event before generate() gives up


class LLM:
    """Runs batches of prompts to completion on an in-process engine.

    >>> llm = LLM("smollm2-135m", device="cpu")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].text
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs):
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 sessions: list[str] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists); outputs keep prompt order.

        Every prompt is checked before any starts, so a bad one raises ValueError and runs nothing.
        """
        single = isinstance(prompts, (str, bytes)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            param_list = params
        else:
            param_list = [params or SamplingParams()] * len(prompts)
        ids = [self.engine.check_prompt(self.engine.encode_prompt(p)) for p in prompts]  # all before any runs
        seqs = [self.engine.add_request(p, sp, session=sessions[i] if sessions else None)
                for i, (p, sp) in enumerate(zip(ids, param_list))]
        return self._run_until_done(seqs)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None):
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        prompts = [self.engine.apply_chat_template(c) for c in conversations]
        outs = self.generate(prompts, params)
        return outs[0] if single else outs

    def _run_until_done(self, seqs) -> list[RequestOutput]:
        pending = {s.id: i for i, s in enumerate(seqs)}
        results: list[RequestOutput | None] = [None] * len(seqs)
        idle_steps = 0
        while pending:
            if not self.engine.has_work():
                raise RuntimeError("engine stopped with requests unfinished")
            before = (self.engine.step_count, self.engine.event_count)
            for out in self.engine.step():
                if out.finished and out.id in pending:
                    results[pending.pop(out.id)] = out
            idle_steps = idle_steps + 1 if (self.engine.step_count, self.engine.event_count) == before else 0
            if idle_steps > STALL_STEPS:
                raise RuntimeError(f"engine made no progress in {STALL_STEPS} steps with requests waiting")
        return results  # type: ignore[return-value]

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def close(self) -> None:
        """Abort whatever still runs, free its blocks and stop the compression worker."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
