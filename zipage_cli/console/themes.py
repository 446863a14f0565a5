"""Console themes through Textual's theme API: the palettes in `zipage.themes` are registered on the
app and switched with `App.theme`; the one stylesheet (zipage.themes' console.tcss) reads their
$z-* variables, so a switch restyles everything without moving anything."""

from __future__ import annotations

from importlib import resources

from textual.app import App
from textual.binding import Binding

from zipage.themes import STYLESHEET, THEMES


def theme_names() -> list[str]:
    return list(THEMES)


def check_theme(name: str) -> str:
    """The theme name, or ValueError listing the ones that exist."""
    if name not in THEMES:
        raise ValueError(f"unknown theme {name!r}; choose one of: {', '.join(THEMES)}")
    return name


class ThemedApp(App):
    """An App coloured by one of the Zipage themes; ctrl+t cycles through them."""

    CSS_PATH = str(resources.files("zipage.themes").joinpath(STYLESHEET))
    THEME_BINDING = Binding("ctrl+t", "cycle_theme", "Theme", tooltip="Cycle the colour themes")
    DEFAULT_CSS = ".pane { padding: 0 1; }"  # every bordered pane of both apps

    def __init__(self, theme_name: str = "dark"):
        check_theme(theme_name)
        super().__init__()
        for theme in THEMES.values():
            self.register_theme(theme)
        self.theme = theme_name

    @property
    def theme_name(self) -> str:
        return self.theme

    def apply_theme(self, name: str) -> None:
        self.theme = check_theme(name)

    def action_cycle_theme(self) -> None:
        names = theme_names()
        self.theme = names[(names.index(self.theme) + 1) % len(names)]
        self.notify(f"theme: {self.theme}", timeout=1.5)
