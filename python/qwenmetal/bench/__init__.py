"""`qwenmetal bench` (see :mod:`qwenmetal.bench.cli` and docs/benchmarks.md), split by job:

* :mod:`.checkpoint` -- real-width configs and the cached random-weight checkpoint (written by the one
  random-checkpoint writer, :mod:`qwenmetal.checkpoint_writer`);
* :mod:`.bandwidth` -- the memory read-bandwidth probe;
* :mod:`.bytes_model` -- bytes moved per decoded token;
* :mod:`.load` -- detection of other work on the machine;
* :mod:`.timing` -- timed prefill / decode, prompt, digest, peak RSS, the machine (``_core.cpu_info()``) and its
  one-line label;
* :mod:`.speculative` -- ``--speculative``: verification cost and greedy tok/s with an oracle drafter;
* :mod:`.batch` -- ``--batch``: one decode_batch step over B sessions against batch 1 and the union floor;
* :mod:`.cli` -- the run, its table and JSON, the command-line arguments.

The names below are the public API (``qwenmetal.bench.X``), re-exported from those modules.
"""
from .bandwidth import measure_read_bandwidth
from .bytes_model import BACKEND_KV_DEFAULT, KV_ELEMENT_BYTES, STATE_ELEMENT_BYTES, decode_bytes, tensor_sizes
from .checkpoint import (
                         CHECKPOINT_FORMAT,
                         ensure_checkpoint,
                         layer_types,
                         qwen35_397b_config,
                         real_config,
                         resolve_config,
)
from .cli import (
                         DEFAULT_CONTEXTS,
                         DEFAULT_PREFILL,
                         QUICK_CONTEXTS,
                         QUICK_PREFILL,
                         SCHEMA,
                         add_arguments,
                         format_encode_only,
                         format_table,
                         main,
                         main_args,
                         run,
                         run_encode_only,
)
from .load import ForeignLoad, busy_fraction, wait_quiet
from .timing import (
                         PROMPT_MULTIPLIER,
                         describe_machine,
                         fnv1a,
                         machine_info,
                         peak_rss_bytes,
                         synthetic_prompt,
                         time_decode,
                         time_prefill,
)

__all__ = ["measure_read_bandwidth", "BACKEND_KV_DEFAULT", "KV_ELEMENT_BYTES", "STATE_ELEMENT_BYTES",
           "decode_bytes", "tensor_sizes", "CHECKPOINT_FORMAT", "ensure_checkpoint", "layer_types", "qwen35_397b_config", "real_config",
           "resolve_config", "DEFAULT_CONTEXTS", "DEFAULT_PREFILL", "QUICK_CONTEXTS", "QUICK_PREFILL", "SCHEMA",
           "add_arguments", "format_encode_only", "format_table", "main", "main_args", "run", "run_encode_only",
           "ForeignLoad", "busy_fraction", "wait_quiet", "PROMPT_MULTIPLIER", "describe_machine", "fnv1a", "machine_info",
           "peak_rss_bytes", "synthetic_prompt", "time_decode", "time_prefill"]
