"""Textual CSS themes for the Zipage console (package data: dark, light, high-contrast)."""
