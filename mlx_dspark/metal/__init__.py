"""Verification attention kernels: Metal body, CUDA twin, MLX reference."""

from .dispatch import kernel_backend, tree_attention
from .reference import ancestor_bitmask, mask_from_bitmask, tree_attention_reference

__all__ = [
    "ancestor_bitmask",
    "kernel_backend",
    "mask_from_bitmask",
    "tree_attention",
    "tree_attention_reference",
]
