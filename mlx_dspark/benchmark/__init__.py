"""Side-by-side speed and acceptance report, roofline, synthetic pairs, parity.

The command is ``mlx_dspark benchmark`` (:mod:`mlx_dspark.cli.benchmark`, which
documents the flags). The library parts, by section:

- :mod:`.prompts`: the prompt sets and prompt encoding;
- :mod:`.modes`: the pair, the decoding modes and their registry;
- :mod:`.measure`: interleaved trials, records, the machine and its roofline;
- :mod:`.schema` and :mod:`.report`: the JSON schema, JSON and PNG files;
- :mod:`.parity`: golden greedy traces across backends.
"""

from .measure import (
    Measurement,
    machine_report,
    measure,
    records,
    target_bytes_per_step,
)
from .modes import (
    DRAFTER_MODES,
    MODES,
    Pair,
    Run,
    Settings,
    Variant,
    dspark_runner,
    make_useless,
    mlx_lm_runner,
    randomize_weights,
    run_target,
    select_variants,
)
from .parity import (
    PARITY_FORMAT,
    check_trace,
    fingerprint,
    first_divergence,
    read_trace,
    record_trace,
)
from .prompts import PROMPT_SETS, encode_prompt, load_prompts
from .report import write_json, write_plots
from .schema import RECORD_SCHEMA, REPORT_SCHEMA, SCHEMA_VERSION, validate

__all__ = [
    "DRAFTER_MODES", "MODES", "PARITY_FORMAT", "PROMPT_SETS", "RECORD_SCHEMA",
    "REPORT_SCHEMA", "SCHEMA_VERSION", "Measurement", "Pair", "Run", "Settings",
    "Variant", "check_trace", "dspark_runner", "encode_prompt", "fingerprint",
    "first_divergence", "load_prompts", "machine_report", "make_useless",
    "measure", "mlx_lm_runner", "randomize_weights", "read_trace", "record_trace",
    "records", "run_target", "select_variants", "target_bytes_per_step", "validate",
    "write_json", "write_plots",
]  # fmt: skip
