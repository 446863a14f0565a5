"""The step loop: `EngineCore` admits requests, schedules a step, runs it, lands compressions, and
reports outputs and events. The one object that holds every other part of the engine.
Imports: `execution`, `scheduling`, `kv`, `loading` and the shared modules; never `api`.
"""
