"""The console's colour themes, as Textual themes: one palette of $z-* variables per theme, read by
the one stylesheet console.tcss. Registered on the apps and switched with `App.theme`."""

from __future__ import annotations

from textual.theme import Theme

STYLESHEET = "console.tcss"  # package data, next to this file


def _theme(name: str, dark: bool, **palette: str) -> Theme:
    """A Textual theme whose variables are the palette (`key_name` becomes `$z-key-name`); Textual's
    own base colours follow it, for the widget parts the stylesheet does not restyle."""
    return Theme(name=name, dark=dark, primary=palette["accent"], background=palette["bg"],
                 surface=palette["pane"], panel=palette["bar"], foreground=palette["text"],
                 error=palette["error"], variables={"z-" + k.replace("_", "-"): v for k, v in palette.items()})


# Deep blue-grey panes, soft accents.
DARK = _theme(
    "dark", True,
    bg="#0f1218", pane="#161a23", bar="#1b2130", border="#2d3446", text="#d5dae5", quiet="#6b7489",
    dim="#6b7489", accent="#7aa2f7", header_fg="#d5dae5", key_bg="#28324a", key_fg="#7aa2f7", error="#f7768e",
    line="round", message_line="thick", focus="#7aa2f7 70%", strong="none", emphasis="bold", alarm="bold",
    rule="#2d3446", table_header="#1f2636", cursor_bg="#2a3a5e", cursor_fg="#ffffff",
    spark_prefill_high="#7dcfff", spark_prefill_low="#3d59a1", spark_decode_high="#9ece6a",
    spark_decode_low="#2f5a3a",
    role_shared="#7dcfff", role_reused="#73daca", role_private="#9ece6a", role_target="#bb9af7", role_decode="#e0af68",
    role_cached="#4f6a8f", role_free="#343b4d",
    owner_0="#7aa2f7", owner_1="#9ece6a", owner_2="#e0af68", owner_3="#bb9af7", owner_4="#7dcfff",
    owner_5="#f7768e", owner_6="#ff9e64", owner_7="#73daca", owner_8="#c0caf5", owner_9="#db4b4b",
    owner_10="#b4f9f8", owner_11="#d4b26a",
    selected="#3b4a6b", selected_style="bold", mark_bg="#3b4a6b", mark_style="none",
    event_admitted="#7dcfff", event_prefilled="#7aa2f7", event_compressed="#bb9af7", event_preempted="#ff9e64",
    event_finished="#9ece6a", event_aborted="#e0af68",
    empty="#2a3142", user="#9ece6a", user_bg="#1a2119", settings_fg="#6b7489", backdrop="#0f1218 60%",
)

# Paper-white panes, ink text, saturated role colours that read on white.
LIGHT = _theme(
    "light", False,
    bg="#eef0f5", pane="#ffffff", bar="#dfe4ee", border="#c3c9d6", text="#222834", quiet="#6c7486",
    dim="#6c7486", accent="#2f5bd3", header_fg="#222834", key_bg="#c9d3ea", key_fg="#2f5bd3", error="#c0392b",
    line="round", message_line="thick", focus="#2f5bd3 70%", strong="none", emphasis="bold", alarm="bold",
    rule="#c3c9d6", table_header="#e4e9f3", cursor_bg="#cfdcfb", cursor_fg="#000000",
    spark_prefill_high="#0b7db3", spark_prefill_low="#a9cde3", spark_decode_high="#2e8540",
    spark_decode_low="#b5dcbd",
    role_shared="#0b7db3", role_reused="#0f766e", role_private="#2e8540", role_target="#8a3ab9", role_decode="#b36b00",
    role_cached="#8fa6c7", role_free="#d0d5df",
    owner_0="#2f5bd3", owner_1="#2e8540", owner_2="#b36b00", owner_3="#8a3ab9", owner_4="#0b7db3",
    owner_5="#c0392b", owner_6="#d35400", owner_7="#16a085", owner_8="#34495e", owner_9="#8e44ad",
    owner_10="#7f8c00", owner_11="#a0522d",
    selected="#ffe9a8", selected_style="bold", mark_bg="#ffe9a8", mark_style="none",
    event_admitted="#0b7db3", event_prefilled="#2f5bd3", event_compressed="#8a3ab9", event_preempted="#c25e00",
    event_finished="#2e8540", event_aborted="#9a7400",
    empty="#dde2ec", user="#2e8540", user_bg="#eef7ef", settings_fg="#6c7486", backdrop="#eef0f5 60%",
)

# Black background, white text, pure saturated colours, heavy borders, bold where it helps.
HIGH_CONTRAST = _theme(
    "high-contrast", True,
    bg="#000000", pane="#000000", bar="#000000", border="#ffffff", text="#ffffff", quiet="#ffffff",
    dim="#c0c0c0", accent="#ffff00", header_fg="#ffff00", key_bg="#ffff00", key_fg="#000000", error="#ff0000",
    line="heavy", message_line="heavy", focus="#ffff00", strong="bold", emphasis="bold underline",
    alarm="bold reverse", rule="#808080", table_header="#000000", cursor_bg="#ffff00", cursor_fg="#000000",
    spark_prefill_high="#00ffff", spark_prefill_low="#00ffff", spark_decode_high="#00ff00",
    spark_decode_low="#00ff00",
    role_shared="#00ffff", role_reused="#00ffaa", role_private="#00ff00", role_target="#ff00ff", role_decode="#ffff00",
    role_cached="#ffffff", role_free="#808080",
    owner_0="#ffff00", owner_1="#00ff00", owner_2="#00ffff", owner_3="#ff00ff", owner_4="#ffffff",
    owner_5="#ff8000", owner_6="#ff0000", owner_7="#8080ff", owner_8="#80ff80", owner_9="#ff80ff",
    owner_10="#ffff80", owner_11="#80ffff",
    selected="#ffffff", selected_style="bold reverse", mark_bg="#000000", mark_style="reverse",
    event_admitted="#00ffff", event_prefilled="#ffffff", event_compressed="#ff00ff", event_preempted="#ff8000",
    event_finished="#00ff00", event_aborted="#ffff00",
    empty="#808080", user="#00ff00", user_bg="#000000", settings_fg="#ffff00", backdrop="#000000 80%",
)

THEMES = {t.name: t for t in (DARK, LIGHT, HIGH_CONTRAST)}  # in the order ctrl+t cycles them
