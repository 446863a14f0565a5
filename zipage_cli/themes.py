"""Console themes: one .tcss file per theme in the `themes` package, swapped at runtime.

A theme file holds colours only (layout lives in each app's CSS), so swapping the file restyles
everything without moving anything. Textual's own base theme (dark or light) is switched along
with it, for the widget parts a theme file does not restyle.
"""

from __future__ import annotations

from importlib import resources

from textual.app import App
from textual.binding import Binding

ORDER = ("dark", "light", "high-contrast")  # the cycle order; other .tcss files follow, sorted
BASE_THEME = {"light": "textual-light"}  # every other theme sits on textual-dark
THEME_SOURCE = "zipage-theme"  # the stylesheet key under which the current theme file is loaded


def theme_names() -> list[str]:
    found = {f.name.removesuffix(".tcss") for f in resources.files("zipage.themes").iterdir() if f.name.endswith(".tcss")}
    return [n for n in ORDER if n in found] + sorted(found - set(ORDER))


def check_theme(name: str) -> str:
    """The theme name, or ValueError listing the ones that exist."""
    names = theme_names()
    if name not in names:
        raise ValueError(f"unknown theme {name!r}; choose one of: {', '.join(names)}")
    return name


def theme_css(name: str) -> str:
    return resources.files("zipage.themes").joinpath(f"{check_theme(name)}.tcss").read_text(encoding="utf-8")


class ThemedApp(App):
    """An App whose colours come from a theme file; ctrl+t cycles through the themes."""

    THEME_BINDING = Binding("ctrl+t", "cycle_theme", "Theme", tooltip="Cycle the colour themes")

    def __init__(self, theme_name: str = "dark"):
        super().__init__()
        self.theme_name = check_theme(theme_name)

    def on_mount(self) -> None:
        self.apply_theme(self.theme_name)

    def apply_theme(self, name: str) -> None:
        css = theme_css(name)
        # Replace the previous theme's rules: one source key holds whichever theme is current.
        self.stylesheet.add_source(css, read_from=(THEME_SOURCE, ""), is_default_css=False)
        self.theme_name = name
        self.theme = BASE_THEME.get(name, "textual-dark")
        self.refresh_css()

    def action_cycle_theme(self) -> None:
        names = theme_names()
        name = names[(names.index(self.theme_name) + 1) % len(names)]
        self.apply_theme(name)
        self.notify(f"theme: {name}", timeout=1.5)
