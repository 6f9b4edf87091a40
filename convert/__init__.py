"""Converters: DeepSpec / speculators drafters and GGUF targets to MLX."""
