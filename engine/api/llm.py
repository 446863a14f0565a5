"""Offline API: LLM(model, **knobs).generate(prompts, params)."""

from __future__ import annotations

import torch

from zipage.engine.config import DEFAULT_MODEL, EngineConfig, SamplingParams
from zipage.engine.core.engine_core import EngineCore
from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import EngineSnapshot

STALL_STEPS = 10_000  # steps without a forward pass or an event before generate() gives up


def _prompt_list(prompts) -> list:
    """One prompt or a list of them, as a list; anything else is a ValueError."""
    if isinstance(prompts, (str, bytes, bytearray)):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts]
        if prompts.dim() == 2:
            return list(prompts)
        raise ValueError(f"a prompt tensor must be 1-D (one prompt) or 2-D (a batch), got {prompts.dim()}-D")
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt as token ids
        return list(prompts)
    raise ValueError("prompts must be a string, a list of token ids, a 1-D tensor, or a list of these; "
                     f"got {type(prompts).__name__}")


class LLM:
    """Runs batches of prompts to completion on an in-process engine: the offline front door (a `Door`
    of engine/api/protocol.py; the streaming doors are EngineThread and the engine process).

    >>> llm = LLM("smollm2-135m", device="cpu")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 sessions: list[str] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings, token-id lists or 1-D tensors); outputs keep
        prompt order.

        Every prompt, parameter and session is checked before any request is queued, so bad input
        raises ValueError and runs nothing. An interrupted call (Ctrl+C) aborts its requests.
        """
        prompts = _prompt_list(prompts)
        if not prompts:
            return []
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            param_list = list(params)
        else:
            param_list = [params or SamplingParams()] * len(prompts)
        for i, sp in enumerate(param_list):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"params[{i}] must be SamplingParams, got {type(sp).__name__}")
            self.engine.check_params(sp)
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"got {len(sessions)} sessions for {len(prompts)} prompts")
        self.engine.check_open()
        ids = [self.engine.check_prompt(self.engine.encode_prompt(p)) for p in prompts]  # all before any runs
        seqs = []
        try:
            for i, (p, sp) in enumerate(zip(ids, param_list)):
                seqs.append(self.engine.enqueue(p, sp, session=sessions[i] if sessions else None))
            return self._run_until_done(seqs)
        except BaseException:  # Ctrl+C or a failure: nothing of this call is left running
            for seq in seqs:
                self.engine.abort(seq.id)
            raise

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None):
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts "
                             "(or a list of such conversations)")
        single = isinstance(messages[0], dict)
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

    def snapshot(self, fresh: bool = False) -> EngineSnapshot:
        """The engine as of now (always fresh: the engine runs in the caller's thread)."""
        return self.engine.snapshot()

    def close(self) -> None:
        """Abort whatever still runs, stop the compression worker and release the KV pool and the
        weights (device memory included). Later calls raise "engine is closed"."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
