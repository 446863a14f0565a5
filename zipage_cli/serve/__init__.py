"""`zipage serve`: the OpenAI-compatible HTTP server in front of an engine process, its Prometheus
metrics, the wire format (OpenAI's log-probabilities in `logprobs.py`), and `RemoteEngine`, the client
the console attaches with.
"""
