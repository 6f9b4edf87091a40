"""Verification attention kernels: Metal body, CUDA twin, MLX reference."""
