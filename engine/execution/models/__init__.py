"""Model families: one decoder with per-family switches."""

from zipage.engine.execution.models.decoder import CausalLM, ForwardBatch, SUPPORTED_FAMILIES, family_of, head_dim_of

__all__ = ["CausalLM", "ForwardBatch", "SUPPORTED_FAMILIES", "family_of", "head_dim_of"]
