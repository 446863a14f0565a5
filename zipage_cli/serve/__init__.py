"""`zipage serve`: the OpenAI-compatible HTTP server in front of an engine process, its Prometheus
metrics, the wire format, and `RemoteEngine`, the client the console attaches with.
"""
