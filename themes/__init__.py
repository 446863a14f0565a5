"""The console's colour themes, as Textual themes: one palette of $z-* variables per theme, read by
the one stylesheet console.tcss. Registered on the apps and switched with `App.theme`."""

from __future__ import annotations

from textual.theme import Theme

STYLESHEET = "console.tcss"  # package data, next to this file

# (name, dark) of each theme, in the order ctrl+t cycles them; each is a column of _PALETTES.
#   dark           deep blue-grey panes, soft accents.
#   light          paper-white panes, ink text, saturated role colours that read on white.
#   high-contrast  black background, white text, pure saturated colours, heavy borders, bold where it helps.
_THEMES = (("dark", True), ("light", False), ("high-contrast", True))

# One row per variable, so no theme can lack one; _theme adds the colours that follow from these.
_PALETTES = {
    #                       dark             light            high-contrast
    "bg":                 ("#0f1218",       "#eef0f5",       "#000000"),
    "pane":               ("#161a23",       "#ffffff",       "#000000"),
    "bar":                ("#1b2130",       "#dfe4ee",       "#000000"),
    "border":             ("#2d3446",       "#c3c9d6",       "#ffffff"),
    "text":               ("#d5dae5",       "#222834",       "#ffffff"),
    "quiet":              ("#6b7489",       "#6c7486",       "#ffffff"),
    "dim":                ("#6b7489",       "#6c7486",       "#c0c0c0"),
    "accent":             ("#7aa2f7",       "#2f5bd3",       "#ffff00"),
    "header_fg":          ("#d5dae5",       "#222834",       "#ffff00"),
    "key_bg":             ("#28324a",       "#c9d3ea",       "#ffff00"),
    "key_fg":             ("#7aa2f7",       "#2f5bd3",       "#000000"),
    "error":              ("#f7768e",       "#c0392b",       "#ff0000"),
    "line":               ("round",         "round",         "heavy"),
    "message_line":       ("thick",         "thick",         "heavy"),
    "focus":              ("#7aa2f7 70%",   "#2f5bd3 70%",   "#ffff00"),
    "strong":             ("none",          "none",          "bold"),
    "emphasis":           ("bold",          "bold",          "bold underline"),
    "alarm":              ("bold",          "bold",          "bold reverse"),
    "rule":               ("#2d3446",       "#c3c9d6",       "#808080"),
    "table_header":       ("#1f2636",       "#e4e9f3",       "#000000"),
    "cursor_bg":          ("#2a3a5e",       "#cfdcfb",       "#ffff00"),
    "cursor_fg":          ("#ffffff",       "#000000",       "#000000"),
    "spark_prefill_low":  ("#3d59a1",       "#a9cde3",       "#00ffff"),
    "spark_decode_low":   ("#2f5a3a",       "#b5dcbd",       "#00ff00"),
    "role_shared":        ("#7dcfff",       "#0b7db3",       "#00ffff"),
    "role_reused":        ("#73daca",       "#0f766e",       "#00ffaa"),
    "role_private":       ("#9ece6a",       "#2e8540",       "#00ff00"),
    "role_target":        ("#bb9af7",       "#8a3ab9",       "#ff00ff"),
    "role_decode":        ("#e0af68",       "#b36b00",       "#ffff00"),
    "role_cached":        ("#4f6a8f",       "#8fa6c7",       "#ffffff"),
    "role_free":          ("#343b4d",       "#d0d5df",       "#808080"),
    "owner_0":            ("#7aa2f7",       "#2f5bd3",       "#ffff00"),
    "owner_1":            ("#9ece6a",       "#2e8540",       "#00ff00"),
    "owner_2":            ("#e0af68",       "#b36b00",       "#00ffff"),
    "owner_3":            ("#bb9af7",       "#8a3ab9",       "#ff00ff"),
    "owner_4":            ("#7dcfff",       "#0b7db3",       "#ffffff"),
    "owner_5":            ("#f7768e",       "#c0392b",       "#ff8000"),
    "owner_6":            ("#ff9e64",       "#d35400",       "#ff0000"),
    "owner_7":            ("#73daca",       "#16a085",       "#8080ff"),
    "owner_8":            ("#c0caf5",       "#34495e",       "#80ff80"),
    "owner_9":            ("#db4b4b",       "#8e44ad",       "#ff80ff"),
    "owner_10":           ("#b4f9f8",       "#7f8c00",       "#ffff80"),
    "owner_11":           ("#d4b26a",       "#a0522d",       "#80ffff"),
    "selected":           ("#3b4a6b",       "#ffe9a8",       "#ffffff"),
    "selected_style":     ("bold",          "bold",          "bold reverse"),
    "mark_bg":            ("#3b4a6b",       "#ffe9a8",       "#000000"),
    "mark_style":         ("none",          "none",          "reverse"),
    "event_prefilled":    ("#7aa2f7",       "#2f5bd3",       "#ffffff"),
    "event_preempted":    ("#ff9e64",       "#c25e00",       "#ff8000"),
    "event_aborted":      ("#e0af68",       "#9a7400",       "#ffff00"),
    "empty":              ("#2a3142",       "#dde2ec",       "#808080"),
    "user":               ("#9ece6a",       "#2e8540",       "#00ff00"),
    "user_bg":            ("#1a2119",       "#eef7ef",       "#000000"),
    "settings_fg":        ("#6b7489",       "#6c7486",       "#ffff00"),
    "backdrop":           ("#0f1218 60%",   "#eef0f5 60%",   "#000000 80%"),
    # The kept view: a token held by no (layer, KV head) pair, by under half, by half or more, by all.
    # High contrast shades by style as well (strike, underline, plain, bold), so it reads without colour.
    "kept_gone":          ("#565f89",       "#9aa1b3",       "#808080"),
    "kept_gone_style":    ("strike",        "strike",        "strike"),
    "kept_partly":        ("#f7768e",       "#c0392b",       "#ff8000"),
    "kept_partly_style":  ("none",          "none",          "underline"),
    "kept_mostly":        ("#e0af68",       "#9a6a00",       "#ffff00"),
    "kept_mostly_style":  ("none",          "none",          "none"),
    "kept_all":           ("#d5dae5",       "#222834",       "#ffffff"),
    "kept_all_style":     ("none",          "none",          "bold"),
    # The probability view: a token the model gave 90% or more, 50-90%, 10-50%, under 10%. High contrast
    # shades by style as well (bold, plain, underline, reverse), so it reads without colour.
    "prob_sure":          ("#d5dae5",       "#222834",       "#ffffff"),
    "prob_sure_style":    ("none",          "none",          "bold"),
    "prob_likely":        ("#e0af68",       "#9a6a00",       "#ffff00"),
    "prob_likely_style":  ("none",          "none",          "none"),
    "prob_unsure":        ("#ff9e64",       "#d35400",       "#ff8000"),
    "prob_unsure_style":  ("none",          "none",          "underline"),
    "prob_rare":          ("#f7768e",       "#c0392b",       "#ff0000"),
    "prob_rare_style":    ("bold",          "bold",          "reverse"),
}


def _theme(name: str, dark: bool, palette: dict[str, str]) -> Theme:
    """A Textual theme whose variables are the palette (`key_name` becomes `$z-key-name`); Textual's
    own base colours follow it, for the widget parts the stylesheet does not restyle."""
    # Sparkline peaks and these events reuse the page map's role colours, so a colour means one thing
    # across the screen.
    palette = dict(palette, spark_prefill_high=palette["role_shared"], event_admitted=palette["role_shared"],
                   spark_decode_high=palette["role_private"], event_finished=palette["role_private"],
                   event_compressed=palette["role_target"])
    return Theme(name=name, dark=dark, primary=palette["accent"], background=palette["bg"],
                 surface=palette["pane"], panel=palette["bar"], foreground=palette["text"],
                 error=palette["error"], variables={"z-" + k.replace("_", "-"): v for k, v in palette.items()})


DARK, LIGHT, HIGH_CONTRAST = (_theme(name, dark, {key: row[column] for key, row in _PALETTES.items()})
                              for column, (name, dark) in enumerate(_THEMES))
THEMES = {t.name: t for t in (DARK, LIGHT, HIGH_CONTRAST)}  # in the order ctrl+t cycles them
