"""A picture of what a request's KV held over time, as a standalone SVG: one row per compression (the
kept map taken right after it, engine/kv/kept.py), x = token position, colour = the share of
(layer, KV head) pairs still holding the position. The prompt/answer boundary and marked spans (a
needle, a fact) are drawn across the rows, so a span that is being forgotten can be seen fading.

Pure: KeptMaps and token texts in, SVG text out (`zipage eval --trace` writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from zipage.engine.kv.kept import KeptMap

PLOT_WIDTH = 960  # px for all positions
LEFT = 150  # row labels
RIGHT = 130  # each mark's share per row
ROW = 16
GAP = 2
TOP = 84  # title, subtitle, mark labels, the answer's label
# A sequential scale from "held by a few" to "held everywhere"; gone is grey, so it reads apart from "few".
SCALE = ("#ffffb2", "#fecc5c", "#41b6c4", "#2c7fb8", "#0c2c84")
GONE = "#e4e4e4"
MARK_COLOURS = ("#d7191c", "#7b3294", "#008837", "#e66101")


@dataclass(frozen=True)
class Mark:
    """A span of positions to point at (a needle, a fact), with a label."""

    label: str
    start: int
    end: int  # one past the last position


def colour(share: float) -> str:
    """The fill for a share: grey when gone, else along SCALE."""
    if share <= 0:
        return GONE
    x = min(1.0, share) * (len(SCALE) - 1)
    i = min(int(x), len(SCALE) - 2)
    return _mix(SCALE[i], SCALE[i + 1], x - i)


def _mix(a: str, b: str, t: float) -> str:
    ca = [int(a[k:k + 2], 16) for k in (1, 3, 5)]
    cb = [int(b[k:k + 2], 16) for k in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb))


def find_marks(pieces: list[str], spans: list[tuple[str, str]], within: int | None = None) -> list[Mark]:
    """Marks for the first occurrence of each (label, text) in the joined token texts (before position
    `within` if given); a text that is not found is left out."""
    starts, offset = [], 0
    for piece in pieces:
        starts.append(offset)
        offset += len(piece)
    joined = "".join(pieces)
    limit = len(joined) if within is None or within >= len(pieces) else starts[within]
    marks = []
    for label, text in spans:
        at = joined.find(text, 0, limit)
        if at < 0 or not text:
            continue
        first = max(i for i, s in enumerate(starts) if s <= at)
        last = max(i for i, s in enumerate(starts) if s < at + len(text))
        marks.append(Mark(label, first, last + 1))
    return marks


def _runs(holders: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, holders) of each run of equal holder counts."""
    runs, start = [], 0
    for p in range(1, len(holders) + 1):
        if p == len(holders) or holders[p] != holders[start]:
            runs.append((start, p, holders[start]))
            start = p
    return runs


def _text(x: float, y: float, words: str, size: int = 11, anchor: str = "start", weight: str = "normal",
          fill: str = "#222") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{fill}">{escape(words)}</text>')


def kept_svg(maps: list[KeptMap], pieces: list[str], prompt_tokens: int, marks: list[Mark] = (),
             title: str = "", subtitle: str = "") -> str:
    """The SVG: `maps` in order (one row each), `pieces` the text of every position (for the marks'
    labels), `prompt_tokens` where the answer starts."""
    total = max([m.num_positions for m in maps] + [len(pieces), prompt_tokens, 1])
    scale = PLOT_WIDTH / total
    height = TOP + max(1, len(maps)) * (ROW + GAP) + 70
    width = LEFT + PLOT_WIDTH + RIGHT

    def x(position: float) -> float:
        return LEFT + position * scale

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
           _text(10, 20, title, 14, weight="bold"), _text(10, 38, subtitle, 11, fill="#555")]
    if not maps:
        out.append(_text(LEFT, TOP + 12, "no compression ran: every position was held to the end", 12))
    for row, kmap in enumerate(maps):
        y = TOP + row * (ROW + GAP)
        pairs = kmap.num_layers * kmap.num_kv_heads
        out.append(f'<g class="row" data-compressions="{kmap.compressions}" data-positions="{kmap.num_positions}">'
                   f'<title>after compression {kmap.compressions}: {kmap.num_positions} positions written, '
                   f'{pairs} (layer, KV head) pairs</title>')
        out.append(_text(LEFT - 8, y + ROW - 4,
                         f"compression {kmap.compressions} · {kmap.num_positions} pos.", 10, anchor="end"))
        for start, end, held in _runs(kmap.holders()):
            share = held / pairs if pairs else 0.0
            out.append(f'<rect x="{x(start):.2f}" y="{y}" width="{(end - start) * scale:.2f}" height="{ROW}" '
                       f'fill="{colour(share)}" data-from="{start}" data-to="{end}" data-share="{share:.4f}"/>')
        shares = kmap.share()
        for k, mark in enumerate(marks):
            span = [shares[p] for p in range(mark.start, min(mark.end, kmap.num_positions))]
            if span:
                mean = sum(span) / len(span)
                out.append(_text(LEFT + PLOT_WIDTH + 8 + 62 * k, y + ROW - 4, f"{mark.label} {mean:.0%}", 10,
                                 fill=MARK_COLOURS[k % len(MARK_COLOURS)]))
        out.append("</g>")
    bottom = TOP + max(1, len(maps)) * (ROW + GAP)
    if 0 < prompt_tokens < total:  # the answer starts here
        out.append(f'<line x1="{x(prompt_tokens):.2f}" y1="{TOP - 6}" x2="{x(prompt_tokens):.2f}" y2="{bottom}" '
                   'stroke="#000" stroke-width="1.5" stroke-dasharray="4 2"/>')
        out.append(_text(x(prompt_tokens) + 3, TOP - 8, "answer →", 10))
    for k, mark in enumerate(marks):
        c = MARK_COLOURS[k % len(MARK_COLOURS)]
        words = "".join(pieces[mark.start:mark.end]).strip()
        words = words if len(words) <= 48 else words[:47] + "…"
        out.append(f'<rect x="{x(mark.start):.2f}" y="{TOP - 3}" width="{max(2.0, (mark.end - mark.start) * scale):.2f}" '
                   f'height="{bottom - TOP + 4}" fill="none" stroke="{c}" stroke-width="1.5" class="mark"/>')
        out.append(_text(x(mark.start), TOP - 22 - 12 * (k % 2), f"{mark.label}: {words}", 10,
                         anchor="middle" if mark.start * scale > 120 else "start", fill=c))
    out.append(_text(LEFT, bottom + 16, "0", 10))
    out.append(_text(LEFT + PLOT_WIDTH, bottom + 16, f"{total} positions", 10, anchor="end"))
    out += _legend(LEFT, bottom + 32)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend(left: float, y: float) -> list[str]:
    parts = [_text(left, y + 10, "share of (layer, KV head) pairs holding a position:", 10)]
    left += 280
    parts.append(f'<rect x="{left}" y="{y}" width="14" height="12" fill="{GONE}"/>')
    parts.append(_text(left + 18, y + 10, "gone everywhere", 10))
    left += 110
    for k in range(1, 11):
        parts.append(f'<rect x="{left + (k - 1) * 14}" y="{y}" width="14" height="12" fill="{colour(k / 10)}"/>')
    parts.append(_text(left - 2, y + 24, "few", 9))
    parts.append(_text(left + 140, y + 24, "kept everywhere", 9, anchor="end"))
    return parts
