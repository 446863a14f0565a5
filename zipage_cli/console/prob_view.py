"""The probability view: how likely the model found each token of an answer (docs/design-notes.md,
"Log-probabilities", its bullet on the console's probability view).

The answer's text is shaded by each token's probability under the model's raw distribution, in four
levels; a cursor (arrow keys or a click) picks a token and shows its log-probability, probability and
rank, and the most likely tokens at its place. Everything it draws came with the answer's tokens, so
it asks the engine nothing: it reads the console's own record a few times a second while the answer
runs.
"""

from __future__ import annotations

from typing import Callable

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding

from zipage.cli.console.prob_source import Scored
from zipage.cli.console.prob_words import (GLYPHS, LEVEL_LABELS, LEVELS, alternatives, bar, level, percent,
                                           probability, shown, summary, token_line)
from zipage.cli.console.token_view import CURSOR_BINDINGS, Shading, Styled, TokenScreen, TokenText

REFRESH_S = 0.5  # the console's record of a running answer is read this often (no engine call)
PROB_HELP = "How likely each token of the answer was, and what else the model weighed there"
# The help screens' words on the view.
PROB_TERMS = """\
The probability view: the answer, each token shaded by the probability the model gave it under its
raw distribution, before temperature and the sampling filters (█ 90% or more, ▓ 50–90%, ░ 10–50%,
· under 10%). Arrow keys or a click pick a token; below it are its log-probability, probability and
rank, and the most likely tokens at its place with theirs (▶ marks the token given)."""


class ProbStyled(Styled):
    """Base of the probability view's widgets: each level's look lives in the theme (themes/console.tcss)."""

    SHADING = Shading("prob", LEVELS, GLYPHS, LEVEL_LABELS)


class ProbText(ProbStyled, TokenText):
    """The answer, each token shaded by its probability; the cursor token marked."""

    CURSOR_OVER = Style(reverse=False)  # the cursor's colours win over high contrast's reverse (the rarest tokens)

    def show(self, scored: Scored) -> None:
        self.show_text(scored.pieces, [level(entry.logprob) for entry in scored.entries])


class ProbScreen(TokenScreen):
    """How likely each token of one answer was. `read()` gives the answer so far (a Scored), or a
    sentence saying why there is none; it is quick and asks the engine nothing."""

    BINDINGS = [Binding("escape,f4,alt+p,p,q", "close", "Close", tooltip="Close the probability view"),
                *CURSOR_BINDINGS]
    DEFAULT_CSS = "ProbScreen #prob-detail-pane { height: auto; max-height: 50%; }"
    STYLED, TEXT = ProbStyled, ProbText
    TEXT_TITLE = "How likely each token of {title} was"
    HINTS = "←/→ token · ↑/↓ line · Home/End · click a token · Esc closes"

    def __init__(self, title: str, read: Callable[[], Scored | str], refresh_s: float = REFRESH_S):
        super().__init__(title)
        self.read, self.refresh_s = read, refresh_s
        self.scored: Scored | None = None

    def compose_parts(self) -> ComposeResult:
        self.detail = ProbStyled(id="prob-detail")
        with self.part("detail", "The token under the cursor"):
            yield self.detail

    def on_mount(self) -> None:
        self.reload()
        self.set_interval(self.refresh_s, self.reload)

    def reload(self) -> None:
        """Read the answer again, unless it had ended when last read."""
        if self.scored is not None and self.scored.done:
            return
        result = self.read()
        if isinstance(result, str):
            self.note = result
        else:
            self.scored, self.note = result, None
            if self.cursor is None and result.entries:
                self.cursor = min(range(len(result.entries)), key=lambda i: result.entries[i].logprob)
            self.text.show(result)
        self.show_head()
        self.show_cursor()

    # -- drawing ----------------------------------------------------------------------------
    def count(self) -> int:
        return len(self.scored.entries) if self.scored is not None else 0

    def head_line(self) -> str | None:
        if self.scored is None:
            return None
        return summary(self.scored.entries) + ("" if self.scored.done else " · still answering")

    def describe(self, position: int) -> Text:
        s = self.scored
        entry = s.entries[position]
        words = Text(token_line(entry, position, s.pieces[position] or s.text_of(entry.token_id)) + "\n", "bold")
        rows = alternatives(entry, s.text_of)
        words.append(f"The {len(entry.top)} most likely tokens here:" if entry.top else
                     "The answer asked for no alternatives.", self.detail.style_for("dim"))
        width = max(cell_len(shown(t, text)) for t, text, _, _ in rows)
        for token_id, text, logprob, given in rows:
            style = self.detail.style_for(f"prob--{level(logprob)}")
            words.append("\n")
            words.append("▶ " if given else "  ", Style(bold=True))
            said = shown(token_id, text)
            words.append(said + " " * (width - cell_len(said)) + f" {percent(probability(logprob)):>7} ",
                         style + Style(bold=given))
            words.append(bar(probability(logprob)), style)
        return words

    def action_close(self) -> None:
        self.dismiss()
