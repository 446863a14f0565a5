"""Model loading and text: find a model (registry, hub, local folder, GGUF), read its config,
tokenizer and weights; turn prompts into checked token ids and streamed ids back into text.
Imports: the shared modules only.
"""
