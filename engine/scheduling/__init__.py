"""Scheduling: the waiting and running queues, query slots, chunked prefill, preemption, and which
requests a step runs (a `ScheduledBatch`). Imports: `kv` and the shared modules.
"""
