"""The `zipage` command line (`main.py`) and its products: the console (`console/`), the
OpenAI-compatible server and its client (`serve/`), the quality basket (`eval/`) and `zipage bench`
(`bench.py`). It reaches the engine only through the engine's front doors and events.
"""
