"""The compressed KV pool: paged blocks with reference counts and the prefix cache, the compression
geometry (every length the rules derive), the compressor that scores, selects and compacts, and the
kept map (which positions a request still holds, and why).
Imports: the shared modules and `zipage.kernels`.
"""
