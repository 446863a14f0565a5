"""`zipage eval --trace DIR`: for each sample of each compressed run, the request's kept map right after
each of its compressions (`EngineCore.kept`, asked between steps), drawn as one SVG per sample by
kept_svg. A picture shows where the needle (or the fact, or the chain) sat and how much of it every
compression left."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from zipage.engine.kv.kept import KeptMap
from zipage.cli.eval.kept_svg import find_marks, kept_svg
from zipage.cli.token_texts import token_pieces


@dataclass(frozen=True)
class TraceTo:
    """Where a run's pictures go, and what names them."""

    folder: str
    task: str
    configuration: str
    budget: str


class Tracer:
    """Collects, while `drive` runs one group, each request's kept map after each compression."""

    def __init__(self, engine):
        self.engine = engine
        self.maps: dict[int, list[KeptMap]] = defaultdict(list)

    def compressed(self, index: int, seq) -> None:
        """drive's hook: request `index` (its Sequence `seq`) was just compressed and still runs."""
        self.maps[index].append(self.engine.kept(seq.id))


def slug(text: str) -> str:
    """"pure scoring" -> "pure-scoring", "25%" -> "25pct"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("%", "pct")).strip("-")


def sample_svg(maps: list[KeptMap], prompt: list[int], output: list[int], tokenizer,
               spans: list[tuple[str, str]], title: str, free_tokens: int) -> str:
    """One sample's picture: its text's pieces, the spans marked where the prompt holds them, and the
    tokens it generated freely (its answer) in the subtitle."""
    pieces = token_pieces(tokenizer, prompt + output)
    marks = find_marks(pieces, spans, within=len(prompt))
    answer = tokenizer.decode(output[len(output) - free_tokens:] if free_tokens else [], skip_special_tokens=True)
    answer = " ".join(answer.split())
    subtitle = (f"{len(prompt)} prompt tokens, {len(output)} output tokens"
                + (f"; it answered {answer[:60]!r}" if free_tokens else "")
                + "; each row: what the cache held right after that compression")
    return kept_svg(maps, pieces, len(prompt), marks, title, subtitle)


def write_group(target: TraceTo, tracer: Tracer, requests: list, outputs: list[list[int]], tokenizer,
                spans, group: int, first: int) -> list[Path]:
    """One SVG per request of a group, numbered from `first` across the task's samples."""
    folder = Path(target.folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i, (request, output) in enumerate(zip(requests, outputs)):
        number = first + i
        title = f"{target.task} · {target.configuration} @ {target.budget} · sample {number}"
        svg = sample_svg(tracer.maps.get(i, []), list(request.prompt), list(output), tokenizer,
                         spans(group, i) if spans else [], title, request.free_tokens)
        path = folder / f"{target.task}-{slug(target.configuration)}-{slug(target.budget)}-{number:03d}.svg"
        path.write_text(svg, encoding="utf-8")
        written.append(path)
    return written
