"""The benchmark JSON schema (a small subset of JSON Schema, validated by hand)."""

from __future__ import annotations

import math
from typing import Any

SCHEMA_VERSION = "mlx-dspark-benchmark/1"


_NUMBER = {"type": "number", "minimum": 0}
_OPT_NUMBER = {"type": ["number", "null"], "minimum": 0}

RECORD_SCHEMA: dict = {
    "type": "object",
    "required": [
        "mode",
        "kind",
        "synthetic",
        "tok_per_s",
        "tok_per_s_min",
        "tok_per_s_max",
        "tok_per_s_trials",
        "speedup",
        "ceiling_fraction",
        "mean_accepted_length",
        "acceptance_by_position",
        "draft_time_s",
        "verify_time_s",
        "peak_memory_gb",
        "tokens",
        "rounds",
        "lossless",
    ],
    "properties": {
        "mode": {"type": "string"},
        "kind": {"enum": ["target", "mlx-lm", "dspark"]},
        "synthetic": {"type": "boolean"},
        "num_draft": {"type": ["integer", "null"], "minimum": 0},
        "threshold": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "tok_per_s": {"type": "number", "exclusiveMinimum": 0},
        "tok_per_s_min": _NUMBER,
        "tok_per_s_max": _NUMBER,
        "tok_per_s_trials": {"type": "array", "items": _NUMBER},
        "speedup": {"type": "number", "exclusiveMinimum": 0},
        "ceiling_fraction": _OPT_NUMBER,
        "mean_accepted_length": {"type": "number", "minimum": 1},
        "acceptance_by_position": {
            "type": "array",
            "items": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "draft_time_s": _OPT_NUMBER,
        "verify_time_s": _OPT_NUMBER,
        "peak_memory_gb": _NUMBER,
        "tokens": {"type": "integer", "minimum": 0},
        "rounds": {"type": ["integer", "null"], "minimum": 0},
        "lossless": {"type": ["boolean", "null"]},
    },
}

REPORT_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "synthetic", "pair", "settings", "machine", "records"],
    "properties": {
        "schema": {"enum": [SCHEMA_VERSION]},
        "synthetic": {"type": "boolean"},
        "pair": {"type": "object"},
        "settings": {"type": "object"},
        "machine": {
            "type": "object",
            "required": [
                "backend",
                "blas",
                "blas_gflops",
                "bandwidth_gb_s",
                "target_bytes_per_step",
                "ceiling_tok_per_s",
            ],
            "properties": {
                "backend": {"type": "string"},
                "blas": {"type": "string"},
                "blas_gflops": _OPT_NUMBER,
                "bandwidth_gb_s": _NUMBER,
                "target_bytes_per_step": {"type": "integer", "minimum": 0},
                "ceiling_tok_per_s": _NUMBER,
            },
        },
        "records": {"type": "array", "items": RECORD_SCHEMA},
    },
}

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def validate(instance: Any, schema: dict, path: str = "$") -> list[str]:
    """Errors of ``instance`` against ``schema`` (type, enum, required,
    properties, items, minimum, exclusiveMinimum, maximum); [] when valid."""
    errors = []
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](instance) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {instance!r:.60}"]
    if "enum" in schema and instance not in schema["enum"]:
        return [f"{path}: {instance!r:.60} is not one of {schema['enum']}"]
    if _TYPES["number"](instance):
        if not math.isfinite(instance):
            errors.append(f"{path}: {instance} is not finite")
        elif "minimum" in schema and instance < schema["minimum"]:
            errors.append(f"{path}: {instance} is below {schema['minimum']}")
        elif "exclusiveMinimum" in schema and instance <= schema["exclusiveMinimum"]:
            errors.append(
                f"{path}: {instance} must exceed {schema['exclusiveMinimum']}"
            )
        elif "maximum" in schema and instance > schema["maximum"]:
            errors.append(f"{path}: {instance} is above {schema['maximum']}")
    if isinstance(instance, dict):
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                errors.extend(validate(instance[key], sub, f"{path}.{key}"))
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            errors.extend(validate(item, schema["items"], f"{path}[{i}]"))
    return errors
