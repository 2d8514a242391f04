"""``qwenmetal compare`` (also ``python -m qwenmetal.compare``): qwenmetal beside mlx-lm and llama.cpp on
this machine, the way the published Lily benchmark compares engines, with plots, token agreement and
perplexity (docs/benchmarks.md, "qwenmetal compare").

* :mod:`.cli` -- the run: engines in processes of their own, rounds in alternating order, the quality
  check, the summary;
* :mod:`.engines` -- one engine's process: the timing method, each engine's token stream;
* :mod:`.report` -- compare.json, compare.md, prefill.png / decode.png;
* :mod:`.llama` -- llama.cpp through llama-cpp-python (also used by benchmarks/llama_cpp_compare.py);
* :mod:`.gguf` -- the MLX -> GGUF writer (Q4_0 / f32) for llama.cpp.
"""
from .cli import DEFAULT_LENGTHS, QUICK_LENGTHS, SCHEMA, add_arguments, main, main_args, run, summarize

__all__ = ["DEFAULT_LENGTHS", "QUICK_LENGTHS", "SCHEMA", "add_arguments", "main", "main_args", "run", "summarize"]
