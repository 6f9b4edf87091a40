"""DSpark speculative decoding for mlx-lm models."""
