"""The target's weights in parts small enough for one device call each.

A part is a folder holding ``weights.npz`` (compressed). Its keys are either a
tensor's name (a float32 tensor as it is) or ``NAME|w4`` / ``NAME|w8`` (MLX's
packed affine layout, groups of 32), ``NAME|s`` and ``NAME|b`` (float16
scales and biases; Q8_0 tensors omit ``|b``, which is ``-128 * scale``).
:func:`read_parts` rebuilds float32 tensors bit for bit equal to
``mx.dequantize(...).astype(mx.float32)``: MLX dequantizes float16 groups in
float16, rounding after the product and after the sum, and so does this.

NumPy only: both sides of the route read it (the device has no MLX).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

GROUP = 32


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The unsigned integers of MLX's packing (element ``j`` of a uint32 at
    bits ``j * bits ..``, little endian), as uint8."""
    data = np.ascontiguousarray(packed).view(np.uint8)
    if bits == 8:
        return data
    if bits != 4:
        raise ValueError(f"unsupported bits {bits}")
    values = np.empty((*data.shape[:-1], data.shape[-1] * 2), np.uint8)
    values[..., 0::2] = data & 15
    values[..., 1::2] = data >> 4
    return values


def dequantize_f16(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int
) -> np.ndarray:
    """float32 tensor of float16 groups: ``f16(f16(s * q) + b)``."""
    q = unpack(packed, bits).astype(np.float16)
    shape = q.shape
    q = q.reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    out = q * scales[..., None]
    out += biases[..., None]
    return out.reshape(shape).astype(np.float32)


def read_parts(parts: list[str | Path]) -> dict[str, np.ndarray]:
    """float32 tensors by name from the parts' ``weights.npz``."""
    raw: dict[str, np.ndarray] = {}
    for part in parts:
        with np.load(Path(part) / "weights.npz") as stored:
            raw.update({key: stored[key] for key in stored.files})
    out = {}
    for key, value in raw.items():
        if "|" not in key:
            out[key] = value.astype(np.float32)
            continue
        name, field = key.split("|")
        if not field.startswith("w"):
            continue
        scales = raw[f"{name}|s"]
        biases = raw.get(f"{name}|b")
        if biases is None:
            biases = scales * np.float16(-128)
        out[name] = dequantize_f16(value, scales, biases, int(field[1:]))
    return out
