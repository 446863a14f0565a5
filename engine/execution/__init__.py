"""Execution: the model and its KV cache on a device, batch tensors, CUDA graphs, sampling,
log-probabilities, and the tensor-parallel ranks. Imports: `scheduling` (the batch it runs), `kv`, `loading`, `zipage.kernels`.
"""
