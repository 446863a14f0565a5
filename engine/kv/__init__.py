"""The compressed KV pool: paged blocks with reference counts and the prefix cache, the compression
geometry (every length the rules derive), and the compressor that scores, selects and compacts.
Imports: the shared modules and `zipage.kernels`.
"""
