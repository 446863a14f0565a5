"""Execution: the model and its KV cache on a device, batch tensors, CUDA graphs, sampling,
log-probabilities, the tensor-parallel ranks and the CPU's threads. Imports: `scheduling` (the batch it runs), `kv`, `loading`, `zipage.kernels`.
"""
