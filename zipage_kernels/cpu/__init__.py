"""Native CPU kernels, compiled from C on first use (docs/design-notes.md, "Native CPU kernels")."""
