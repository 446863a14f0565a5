"""Saved chats: every session of `zipage chat` and its turns in a local SQLite file (`store.py`), what
the chat tells it as the user goes (`saver.py`), the session list in the app (`browser.py`), and a
session as Markdown or JSON (`export.py`).
"""
