"""One chat session as Markdown (to read) or JSON (to load elsewhere): `/export PATH` in the chat and
`zipage chat --export SESSION`. The file's suffix picks the format: .json is JSON, anything else Markdown."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from zipage.cli.console.saved.store import SavedSession

JSON_FORMAT = "zipage-chat"
JSON_VERSION = 1


def _when(seconds: float) -> str | None:
    """A moment in local time with its offset (ISO 8601); None where it was never known."""
    return datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds") if seconds else None


def settings_of(session: SavedSession) -> dict:
    return {"temperature": session.temperature, "max_tokens": session.max_tokens, "system": session.system,
            "kv_budget": session.kv_budget}


def to_json(session: SavedSession) -> str:
    """The session's settings, then its messages in order, each as OpenAI's role and content (an answer
    also with the line of figures the chat showed under it)."""
    messages = []
    for m in session.messages:
        message = {"role": m.role, "content": m.content, "created": _when(m.created)}
        if m.meta:
            message["meta"] = m.meta
        messages.append(message)
    body = {"format": JSON_FORMAT, "version": JSON_VERSION, "number": session.id, "name": session.name,
            "model": session.model, "created": _when(session.created), "updated": _when(session.updated),
            "settings": settings_of(session), "messages": messages}
    return json.dumps(body, indent=2, ensure_ascii=False) + "\n"


def to_markdown(session: SavedSession) -> str:
    budget = f" · KV budget {session.kv_budget} blocks" if session.kv_budget is not None else ""
    lines = [f"# {session.name}", "",
             f"{session.model} · temperature {session.temperature:g} · max tokens {session.max_tokens}{budget}"]
    if session.created:
        lines += ["", f"From {_when(session.created)} to {_when(session.updated)}"]
    if session.system:
        lines += ["", f"**System:** {session.system}"]
    messages = session.messages
    for i, m in enumerate(messages):
        if m.role == "user":
            lines += ["", "## You", "", m.content]
            if i + 1 == len(messages) or messages[i + 1].role != "assistant":
                lines += ["", "*(no answer was saved)*"]
        else:
            lines += ["", f"## {session.model}", "", m.content]
            if m.meta:
                lines += ["", f"*{m.meta}*"]
    return "\n".join(lines) + "\n"


def export(session: SavedSession, path: str | Path) -> str:
    """Write the session to `path` (its folder must exist); returns what was written, in words."""
    path = Path(path).expanduser()
    as_json = path.suffix.lower() == ".json"
    try:
        path.write_text(to_json(session) if as_json else to_markdown(session), encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
    turns = sum(1 for m in session.messages if m.role == "assistant")
    return f"{session.name} ({turns} turn{'s' if turns != 1 else ''}) written to {path} as {'JSON' if as_json else 'Markdown'}"
