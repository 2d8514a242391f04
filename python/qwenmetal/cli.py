"""The `qwenmetal` command.

    qwenmetal demo                       # offline: tiny random-weight checkpoint, streamed generation
    qwenmetal demo --model mlx-community/Qwen3.6-35B-A3B-4bit
    qwenmetal info --model PATH_OR_ID    # config, tensor sizes, state sizes
"""
from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPT = "The quick brown fox"
REAL_MODEL = "mlx-community/Qwen3.6-35B-A3B-4bit"


def _add_model_args(p, default_model=None):
    p.add_argument("--model", default=default_model,
                   help="checkpoint directory or Hugging Face hub id" +
                   (" (default: a generated tiny random-weight checkpoint)" if default_model is None else ""))
    p.add_argument("--backend", default="auto", help="reference | auto (default: auto)")


def cmd_demo(args) -> int:
    import qwenmetal as qm

    tiny = args.model is None
    if tiny:
        from .testing import cached_checkpoint
        t = time.perf_counter()
        path = cached_checkpoint("tiny", "mlx-q4", seed=0)
        print(f"tiny random-weight checkpoint (real architecture, MLX 4-bit layout): {path} "
              f"[{time.perf_counter() - t:.2f} s]")
    else:
        path = args.model
    t = time.perf_counter()
    model = qm.Model.load(path, backend=args.backend)
    print(f"loaded on backend {model.backend!r} in {time.perf_counter() - t:.2f} s")
    print(repr(model.config))
    print(f"\nprompt: {args.prompt!r}\n" + "-" * 60)
    sys.stdout.write(args.prompt)
    stats = None
    for out in model.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=args.seed):
        sys.stdout.write(out.text)
        sys.stdout.flush()
        stats = out.stats
    print("\n" + "-" * 60)
    if stats:
        print(f"prompt {stats['prompt_tokens']} tokens: {stats['prefill_tokens_per_second']:.1f} tok/s prefill; "
              f"generated {stats['generated_tokens']} tokens: {stats['decode_tokens_per_second']:.1f} tok/s decode")
    if tiny:
        print("\nNote: these are RANDOM weights, so the text above is noise — the demo shows the whole pipeline\n"
              "(checkpoint -> loader -> forward pass -> sampling -> streaming) working offline.\n"
              f"For the real model: qwenmetal demo --model {REAL_MODEL}")
    return 0


def cmd_info(args) -> int:
    import qwenmetal as qm

    model = qm.Model.load(args.model, backend=args.backend)
    c = model.config
    print(repr(model))
    s = model.new_session()
    print(f"weights: {model.weights.nbytes / 2**20:.1f} MiB as stored ({model.weights.layout} layout)")
    print(f"session state at position 0: {s.nbytes / 2**20:.2f} MiB; KV cache grows by "
          f"{2 * len(c.full_attention_layers) * c.num_key_value_heads * c.head_dim * 2} bytes/token (bf16)")
    if model.tokenizer is not None:
        print(repr(model.tokenizer))
    print(f"stop ids: {list(model.eos_token_ids)}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qwenmetal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate from a tiny offline checkpoint (or --model)")
    _add_model_args(p)
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("info", help="describe a checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face hub id")
    p.add_argument("--backend", default="auto")
    p.set_defaults(func=cmd_info)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, MemoryError) as e:
        print(f"qwenmetal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
