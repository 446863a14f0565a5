"""The front doors: how callers reach an engine.

`LLM` runs batches to completion in the caller's thread; `EngineThread` serves several callers from
a background thread; `EngineProcess` puts the engine in a child process for a server. Every streaming
door speaks the protocol in `protocol.py`, so a console or a test holds any of them the same way.
Imports: this room uses `core` and below; nothing below imports it.
"""
