"""The `qwenmetal` command.

    qwenmetal demo                       # offline: tiny random-weight checkpoint, streamed generation
    qwenmetal demo --model mlx-community/Qwen3.6-35B-A3B-4bit
    qwenmetal generate --model PATH_OR_ID --prompt "Hello" [--chat] [sampling options]
    qwenmetal chat --model PATH_OR_ID    # interactive; /reset /save /load /history /stats /help /exit
    qwenmetal serve --model PATH_OR_ID [--port 8000] [--api-key KEY]   # OpenAI-compatible server
    qwenmetal convert --model HF_PATH_OR_ID --out DIR [--q-bits 4]     # as mlx_lm.convert -q
    qwenmetal convert SRC DST --bits 4 --expert-bits 2    # routed experts at 2 bits, the rest at 4
    qwenmetal info --model PATH_OR_ID    # config, tensor sizes, state sizes, memory estimate, expert streaming
    qwenmetal bench [--layers 8] [--json PATH]   # prefill/decode speed at real width vs memory bandwidth
    qwenmetal bench --backend metal-sim --encode-only [--json PATH]   # the real decode step, costed
    qwenmetal bench --backend metal-sim --kernels [--json PATH]   # per kernel: occupancy, bank conflicts
    qwenmetal selftest [--sim] [--json FILE]   # the Metal backend on this device: a report to paste or attach

Every option is described in docs/usage.md (and docs/server.md for `serve`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from . import bench, compare, expert_streaming, selftest, server, working_set
from .backends import ALL_BACKENDS, BACKENDS
from .chat import chat_turn, validate_messages
from .cli_args import add_expert_args, expert_options, seed_arg
from .config import ModelConfig
from .convert import convert
from .errors import InputError
from .generation import make_drafter
from .grammar import Grammar
from .install_hints import install_hint
from .memory import parse_budget
from .model import Model
from .options import GenerationOptions
from .paths import cache_dir, resolve_checkpoint
from .prefix_cache import PrefixCache
from .sampling import SAMPLING_KEYS
from .session import Session
from .testing import cached_checkpoint
from .transcripts import check_chat_support
from .version import __version__
from .weights import is_routed_expert
from .weights_table import config_widths, virtual_weight_table

DEMO_PROMPT = "The quick brown fox"
REAL_MODEL = "mlx-community/Qwen3.6-35B-A3B-4bit"


def _add_model_args(p, default_model=None, required=False):
    p.add_argument("--model", default=default_model, required=required,
                   help="checkpoint directory or Hugging Face hub id" +
                   (" (default: a generated tiny random-weight checkpoint)" if default_model is None and not required
                    else ""))
    p.add_argument("--backend", default="auto",
                   help=f"auto (default: metal on a Mac, else cpu) | {' | '.join(ALL_BACKENDS)} "
                        f"(available here: {', '.join(BACKENDS)})")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) with a hub id")
    g = p.add_argument_group("models larger than memory (docs/streaming.md)")
    g.add_argument("--memory-budget", default="auto", metavar="BYTES",
                   help="bytes the model may use ('auto', the default: what this machine has free; 'none': never "
                        "stream; or e.g. 12GiB): a checkpoint larger than this streams its routed experts from disk")
    add_expert_args(g)


def _load_options(args) -> dict:
    """The backend options the streaming flags set (`Model.load(**options)`); flags left at their defaults
    are left out, so backends that cannot stream (reference) load as before."""
    o = {}
    if str(args.memory_budget).lower() != "auto":
        o["memory_budget"] = None if str(args.memory_budget).lower() == "none" else args.memory_budget
    return o | expert_options(args)


def bytes_arg(text: str) -> float:
    """argparse type of the byte budgets (--cache-bytes, --cache-dir-bytes): a number >= 0."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of bytes >= 0 (0 disables), got {text!r}")
    return v


#: what each sampling flag's neutral value is (the flags are GenerationOptions' sampling fields)
_SAMPLING_HELP = {"temperature": "0 = greedy", "top_k": "0 = off", "top_p": "1 = off", "min_p": "0 = off",
                  "repetition_penalty": "1 = off", "presence_penalty": "0 = off", "frequency_penalty": "0 = off",
                  "seed": "same seed, same tokens"}


def _add_sampling_args(p, max_tokens=256):
    """The flags of `GenerationOptions.from_cli_args`: --max-tokens, one per sampling parameter, --stop."""
    g = p.add_argument_group("sampling (unset values come from generation_config.json)")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    for k in SAMPLING_KEYS:
        g.add_argument("--" + k.replace("_", "-"), type={"top_k": int, "seed": seed_arg}.get(k, float), default=None,
                       help=_SAMPLING_HELP[k])
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeatable; \\n \\t \\r \\\\ escapes); matched across tokens, not printed")
    g.add_argument("--cache-bytes", type=bytes_arg, default=None, metavar="BYTES",
                   help="prefix cache budget in bytes (0 disables it; default: 10%% of memory, at most 8 GiB)")


def _add_speculative_args(p):
    g = p.add_argument_group("speculative decoding (docs/speculative.md; the output is unchanged)")
    g.add_argument("--speculative", default=None, metavar="DRAFTER",
                   help="'lookup' (n-grams of the session's own tokens), 'mtp' (the checkpoint's MTP head), "
                        "'mtp:DIR' (a separate MTP head folder), 'dflash:DIR' (a DFlash block draft's folder) or a "
                        "draft model's checkpoint directory / hub id (same vocabulary, loaded on --backend)")
    g.add_argument("--speculative-k", type=int, default=None, metavar="K",
                   help="drafts per round, 0..15 (default: chosen from the measured acceptance and cost)")


def _speculative(args, model) -> dict:
    """`Model.generate`'s speculative arguments for --speculative / --speculative-k (a draft model is
    loaded here)."""
    spec = args.speculative
    if spec is None:
        if args.speculative_k is not None:
            raise InputError("--speculative-k needs --speculative", param="speculative_k")
        return {}
    if spec.startswith(("mtp:", "dflash:")):
        spec = make_drafter(spec, model)
    elif spec not in ("lookup", "mtp"):
        threads = model.backend_info().get("threads")
        spec = Model.load(resolve_checkpoint(spec), backend=model.backend,
                             **({"threads": threads} if threads else {}))
    return {"speculative": spec, "speculative_k": args.speculative_k}


def _load(args, quiet: bool = False):
    """Resolve (download with huggingface_hub's progress bars) and load, with a progress line on a terminal."""

    path = resolve_checkpoint(args.model, getattr(args, "revision", None))
    show = not quiet and sys.stderr.isatty()
    if not show:
        model = Model.load(path, backend=args.backend, **_load_options(args))
    else:
        from tqdm.auto import tqdm
        box: dict = {}

        def work():
            try:
                box["model"] = Model.load(path, backend=args.backend, **_load_options(args))
            except BaseException as e:  # re-raised in the main thread
                box["error"] = e

        th = threading.Thread(target=work, daemon=True)
        th.start()
        with tqdm(desc=f"loading {os.path.basename(os.path.normpath(path))}", bar_format="{desc}: {elapsed}",
                  file=sys.stderr, leave=False) as bar:
            while th.is_alive():
                th.join(0.1)
                bar.refresh()
        if "error" in box:
            raise box["error"]
        model = box["model"]
    cb = getattr(args, "cache_bytes", None)
    if cb is not None:
        model.prefix_cache = PrefixCache(int(cb)) if cb > 0 else None
    return model


#: what the speeds of a backend measure, when they are not the hardware's (after the tok/s figures)
SPEED_NOTES = {"metal-sim": "metal-sim: the Metal graph on a CPU simulator, not GPU speed"}


def speed_note(backend: str) -> str:
    """" (what these speeds are)" for a backend whose tok/s are not its hardware's, else ""."""
    note = SPEED_NOTES.get(backend)
    return f" ({note})" if note else ""


def _stats_line(st: dict, backend: str = "") -> str:
    pre = (f"{st['prefill_tokens_per_second']:.1f} tok/s prefill" if st["prefill_tokens"] else "no prefill")
    dec = st["decode_tokens_per_second"]
    dec = f"{dec:.1f} tok/s decode" if dec == dec else "-"
    line = (f"prompt {st['prompt_tokens']} tokens ({st['cached_tokens']} cached), {pre}; "
            f"generated {st['generated_tokens']} tokens, {dec}{speed_note(backend)}; finish: {st['finish_reason']}")
    sp = st.get("speculative")
    if sp:
        rate = sp["acceptance_rate"]
        mean = sp.get("mean_accepted_length")
        line += (f"; speculative ({sp['drafter']}): {sp['accepted_tokens']}/{sp['drafted_tokens']} drafts accepted"
                 + (f" ({100 * rate:.0f} %)" if rate is not None else "")
                 + (f", {mean:.2f} tokens per round" if mean is not None else ""))
    ex = st.get("experts")
    if ex and ex["streaming"]:
        line += (f"; experts streamed: {ex['slots_per_layer']} slots/layer ({ex['policy']}), hit rate "
                 f"{100 * ex['hit_rate']:.1f} %, {ex['bytes_read'] / 2**20:,.1f} MiB read in {ex['io_seconds']:.2f} s")
    return line


# ---------------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    if args.prompt == "":
        raise InputError("the prompt is empty (give --prompt TEXT, or leave it out for the default)", param="prompt")
    tiny = args.model is None
    if tiny:
        t = time.perf_counter()
        path = cached_checkpoint("tiny", "mlx-q4", seed=0)
        print(f"tiny random-weight checkpoint (real architecture, MLX 4-bit layout): {path} "
              f"[{time.perf_counter() - t:.2f} s]")
    else:
        path = args.model
    t = time.perf_counter()
    model = Model.load(path, backend=args.backend, **_load_options(args))
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
              f"generated {stats['generated_tokens']} tokens: {stats['decode_tokens_per_second']:.1f} tok/s decode"
              + speed_note(model.backend))
    if tiny:
        print("\nNote: these are RANDOM weights, so the text above is noise — the demo shows the whole pipeline\n"
              "(checkpoint -> loader -> forward pass -> sampling -> streaming) working offline.\n"
              f"For the real model: qwenmetal demo --model {REAL_MODEL}")
    return 0


def _info_from_config(path: str, args) -> int:
    """`info` on a directory with a config.json and no weights: sizes from the config alone, in the MLX
    layout at the config's quantization block's widths, or at --bits / --expert-bits."""


    c = ModelConfig.from_file(path)
    widths = config_widths(c) if args.bits is None else {"bits": args.bits}
    widths.setdefault("bits", 4)
    if args.expert_bits is not None:
        widths["expert_bits"] = args.expert_bits
    _, tensors, sizes = virtual_weight_table(c, **widths)
    print(repr(c))
    n_params = sum(int(np.prod(t["shape"])) for t in tensors.values())
    routed = sum(v for k, v in sizes.items() if is_routed_expert(k))
    total = sum(sizes.values())
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    eb = widths.get("expert_bits", widths["bits"])
    print(f"no weights in {path}: sizes from config.json, MLX layout at {widths['bits']} bits "
          f"(routed experts {eb}, group {widths.get('group_size', 64)})")
    print(f"parameters (text model): {n_params / 1e9:.3f} B")
    print(f"weights: {total / 1e9:.2f} GB ({total / 2**30:.2f} GiB); routed experts {routed / 1e9:.2f} GB, "
          f"everything else {(total - routed) / 1e9:.2f} GB")
    if moe_layers:
        print(f"one expert of one layer: {routed // (moe_layers * c.num_experts):,} bytes; "
              f"{c.num_experts_per_tok} active per token over {moe_layers} MoE layers: "
              f"{c.num_experts_per_tok * routed / c.num_experts / 1e9:.2f} GB of experts per token")
    for line in expert_streaming.describe(_info_plan(c, sizes, args), args.hit_rate):
        print(line)
    for line in _parallel_lines(c, sizes, args) + _gpu_plan_lines(c, sizes, args, None):
        print(line)
    return 0


def _gpu_plan_lines(config, weights_or_sizes, args, model) -> list[str]:
    """The Metal backends' memory plan (qwenmetal.working_set): for a Mac of --mac-memory, a working set of
    --working-set, or the loaded metal model's own device."""
    if args.working_set is not None:
        ws, where = parse_budget(args.working_set, "working_set"), "given"
    elif args.mac_memory is not None:
        ram = parse_budget(args.mac_memory, "mac_memory")
        ws, where = working_set.mac_working_set(ram), f"a Mac with {ram / 2**30:g} GiB, modelled"
    elif model is not None and model.backend in ("metal", "metal-sim"):
        return list(model.backend_info()["memory_plan"])
    else:
        return []
    o = _load_options(args)
    p = working_set.plan(config, weights_or_sizes, ws, context=args.context,
                         memory_budget=o.get("memory_budget", None), expert_slots=o.get("expert_slots"),
                         expert_policy=o.get("expert_policy"), expert_direct_io=o.get("expert_direct_io", False),
                         parallel=args.parallel or 1)
    lines = p.describe()
    return [lines[0].replace("GPU working set: ", f"GPU working set ({where}): ", 1), *lines[1:]]


def _info_plan(config, weights_or_sizes, args):
    """The expert-streaming plan; with --parallel N it keeps N sessions of --context tokens free (else one of
    the planner's RESERVE_CONTEXT, as a loaded model does)."""
    o = _load_options(args)
    more = {"parallel": args.parallel, "context": args.context} if args.parallel else {}
    return expert_streaming.plan(config, weights_or_sizes, o.get("memory_budget", "auto"),
                          slots_per_layer=o.get("expert_slots"), policy=o.get("expert_policy"),
                          direct_io=o.get("expert_direct_io", False), **more)


def _parallel_lines(config, weights_or_sizes, args) -> list[str]:
    """`info --parallel N`: one session's bytes at --context, N of them, whether they fit the memory budget
    beside the weights, the most that fit, and the default a server would take (expert_streaming.parallel_plan,
    default_parallel). Sized as the cpu backend allocates (its KV grows by need, 1.5x in 256-token blocks:
    the worst case) against the memory budget, or as the Metal graph does (KV in 256-token blocks, the GDN
    state twice) with --backend metal / metal-sim, against the working set with --mac-memory / --working-set."""
    if not args.parallel:
        return []
    budget = _load_options(args).get("memory_budget", "auto")
    backend = "metal" if str(args.backend).startswith("metal") else "cpu"
    if args.working_set is not None or args.mac_memory is not None:     # the sessions live in the GPU's working set
        budget = (parse_budget(args.working_set, "working_set") if args.working_set is not None else
                  working_set.mac_working_set(parse_budget(args.mac_memory, "mac_memory")))
        backend = "metal"
    p = expert_streaming.parallel_plan(config, weights_or_sizes, budget, context=args.context,
                                       parallel=args.parallel, backend=backend)
    n = expert_streaming.default_parallel(config, weights_or_sizes, budget, args.context, backend=backend)
    return [f"{line} ({backend} backend)" if i == 0 else line for i, line in enumerate(p.describe())] + [
        f"  default --parallel for this budget and context: {n} (the most that fit, at most "
        f"{expert_streaming.MAX_DEFAULT_PARALLEL}, at least 1)"]


def cmd_info(args) -> int:


    path = resolve_checkpoint(args.model, getattr(args, "revision", None))
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        return _info_from_config(path, args)
    if args.bits is not None or args.expert_bits is not None:
        raise InputError("--bits / --expert-bits size a config-only directory; this one has weights",
                         param="bits" if args.bits is not None else "expert_bits")
    model = _load(args, quiet=True)
    c = model.config
    print(repr(model))
    s = model.new_session()
    kv_bf16 = 2 * len(c.full_attention_layers) * c.num_key_value_heads * c.head_dim * 2
    fixed = s.nbytes
    n_params = sum(int(np.prod(t.shape)) for t in model.weights.tensors.values())
    print(f"parameters (text model): {n_params / 1e9:.3f} B" if n_params > 1e8 else
          f"parameters (text model): {n_params / 1e6:.3f} M")
    print(f"weights: {model.weights.nbytes / 2**20:.1f} MiB as stored ({model.weights.layout} layout); "
          f"{model.weights.dense_float32_nbytes() / 2**20:.1f} MiB as float32 (the reference backend's copy)")
    print(f"session state at position 0: {fixed / 2**20:.2f} MiB (conv + recurrent state); KV cache grows by "
          f"{kv_bf16} bytes/token (bf16)")
    print("memory estimate (weights as stored + one session, bf16 KV):")
    for ctx in sorted({min(x, c.max_position_embeddings) for x in (4096, 32768, c.max_position_embeddings)}):
        total = model.weights.nbytes + fixed + ctx * kv_bf16
        print(f"  {ctx:>7} tokens of context: {total / 2**20:,.1f} MiB (session state {(fixed + ctx * kv_bf16) / 2**20:,.1f} MiB)")
    for line in expert_streaming.describe(_info_plan(c, model.weights, args), args.hit_rate):
        print(line)
    for line in _parallel_lines(c, model.weights, args) + _gpu_plan_lines(c, model.weights, args, model):
        print(line)
    if model.tokenizer is not None:
        print(repr(model.tokenizer))
    print(f"stop ids: {list(model.eos_token_ids)}")
    if model.generation_config:
        print(f"generation_config: {json.dumps(model.generation_config, sort_keys=True)}")
    return 0


def _json_schema_arg(value: str | None) -> dict | None:
    """--json-schema: a file holding the schema, or its JSON text; checked (compiled) before the model loads."""
    if value is None:
        return None
    text = Path(value).read_text(encoding="utf-8") if not value.lstrip().startswith("{") else value
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"--json-schema: not valid JSON: {e}", param="json_schema") from None
    Grammar.json_schema(schema, "--json-schema")
    return schema


def cmd_generate(args) -> int:
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (a system message is part of the chat template)")
    opts = GenerationOptions.from_cli_args(args)           # checked before the model loads
    schema = _json_schema_arg(args.json_schema)
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if prompt == "" and not args.chat:
        raise InputError("the prompt is empty (give --prompt TEXT, or the text on stdin)", param="prompt")
    model = _load(args)
    spec = _speculative(args, model)
    images = list(args.image or ())
    if args.chat:
        content = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": prompt}] \
            if images else prompt
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": content}]
        rf = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}} if schema else None
        gen = chat_turn(model, msgs, enable_thinking=False if args.no_thinking else None,
                        response_format=rf).generate(model, opts, **spec)
    else:
        grammar = Grammar.json_schema(schema, "--json-schema") if schema is not None else None
        gen = model.generate(prompt, options=opts, images=images or None, grammar=grammar, **spec)
    stats = None
    for out in gen:
        sys.stdout.write(out.text)
        sys.stdout.flush()
        stats = out.stats
    sys.stdout.write("\n")
    if stats and not args.quiet:
        print(_stats_line(stats, model.backend), file=sys.stderr)
    return 0


_CHAT_HELP = """commands:
  /reset         forget the conversation
  /save FILE     save the conversation and its session state (safetensors)
  /load FILE     load a saved conversation (its state goes into the prefix cache)
  /image PATH    attach an image file to your next message
  /history       print the conversation
  /stats         statistics of the last reply
  /help          this text
  /exit, /quit   leave (also Ctrl-D)"""


def cmd_chat(args) -> int:
    opts = GenerationOptions.from_cli_args(args)        # checked before the model loads
    model = _load(args)
    spec = _speculative(args, model)
    check_chat_support(model)                               # ValueError naming the missing file
    tty = sys.stdout.isatty()
    dim, reset = ("\x1b[2m", "\x1b[0m") if tty else ("", "")
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    pending = list(args.image or ())          # images for the next user message (--image, /image)
    last_stats = None
    think = False if args.no_thinking else None
    print(f"qwenmetal chat — {model.path} on {model.backend!r}. /help for commands.", file=sys.stderr)
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:                      # Ctrl-D: end the prompt's line, leave with 0
            if sys.stdin.isatty():
                print()
            break
        # Ctrl-C at the prompt goes to main(), as in every command: a new line, "interrupted", 130
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/help":
                print(_CHAT_HELP)
            elif cmd == "/reset":
                history = list(base)
                print("(conversation cleared)")
            elif cmd == "/image":
                if not arg:
                    print("usage: /image PATH")
                    continue
                pending.append(arg)
                print(f"({len(pending)} image(s) attached to your next message)")
            elif cmd == "/history":
                for m in history:
                    c = m.get("content", "")
                    if isinstance(c, list):
                        c = "".join(f"[image {p.get('image', '')}] " if p.get("type") == "image" else p.get("text", "")
                                    for p in c)
                    print(f"[{m['role']}] {c}")
            elif cmd == "/stats":
                print(_stats_line(last_stats, model.backend) if last_stats else "(no reply yet)")
            elif cmd == "/save":
                if not arg:
                    print("usage: /save FILE")
                    continue
                if len(history) == len(base) and not base:
                    print("(nothing to save yet)")
                    continue
                try:
                    s = model.chat_session(history, enable_thinking=think)
                    s.save(arg)
                except (ValueError, OSError, NotImplementedError) as e:
                    print(f"error: {e}")
                    continue
                print(f"(saved {len(history)} messages, {s.position} tokens to {arg})")
            elif cmd == "/load":
                if not arg:
                    print("usage: /load FILE")
                    continue
                try:
                    s = Session.load(arg, model)    # also puts its state and transcript in the caches
                except (ValueError, OSError, NotImplementedError) as e:
                    print(f"error: {e}")
                    continue
                try:
                    history = validate_messages(s.metadata.get("messages"))
                except ValueError as e:
                    print(f"error: {arg} holds no conversation ({e})")
                    continue
                print(f"(loaded {len(history)} messages, {s.position} tokens)")
            else:
                print(f"unknown command {cmd}; /help lists them")
            continue
        content = [{"type": "image", "image": p} for p in pending] + [{"type": "text", "text": line}] \
            if pending else line
        history.append({"role": "user", "content": content})
        try:
            turn = chat_turn(model, history, enable_thinking=think)
        except ValueError as e:  # invalid messages or images, or a conversation the template refuses
            history.pop()
            print(f"error: {e}")
            continue
        pending = []
        parser = turn.stream_parser()
        pieces, tokens, finished = [], [], False
        mode = None
        try:
            for out in turn.generate(model, opts, **spec):
                pieces.append(out.text)
                tokens.append(out.token)
                for field_, t in [e for e in parser.feed(out.text) + (parser.finish() if out.finish_reason else [])
                                  if e[0] in ("reasoning", "content")]:
                    if field_ == "reasoning":
                        if args.hide_thinking:
                            continue
                        if mode != "r":
                            sys.stdout.write(dim + ("" if tty else "<think>\n"))
                            mode = "r"
                    elif mode == "r":
                        sys.stdout.write(("" if tty else "\n</think>\n") + reset + "\n")
                        mode = "c"
                    sys.stdout.write(t)
                    sys.stdout.flush()
                if out.finish_reason:
                    last_stats, finished = out.stats, True
        except KeyboardInterrupt:
            print("\n(interrupted)")
        if mode == "r":
            sys.stdout.write(reset)
        sys.stdout.write("\n")
        sys.stdout.flush()
        _, content, _ = turn.parse("".join(pieces))
        history.append({"role": "assistant", "content": content})
        if finished:
            turn.remember(model, history[-1], tokens)
        if last_stats and args.verbose:
            print(_stats_line(last_stats, model.backend), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"qwenmetal: error: the server needs the 'server' extra (missing {', '.join(missing)}): "
              f"{install_hint('server')}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("QWENMETAL_API_KEY") or None
    model = _load(args)
    if args.cache_dir is not None:
        model.use_disk_cache(args.cache_dir, None if args.cache_dir_bytes is None else int(args.cache_dir_bytes))
    name = args.served_model_name or (args.model if not os.path.isdir(args.model)
                                      else os.path.basename(os.path.normpath(args.model)))
    spec = _speculative(args, model)
    parallel = args.parallel if args.parallel is not None else _default_parallel(model, spec, args)
    if spec and parallel > 1:
        print("qwenmetal: error: speculative decoding is single-stream: use it with --parallel 1", file=sys.stderr)
        return 2
    print(f"serving {name!r} ({model.backend} backend, {parallel} request(s) at once) on "
          f"http://{args.host}:{args.port}/v1{' (API key required)' if api_key else ''}", file=sys.stderr, flush=True)
    server.serve(model, host=args.host, port=args.port, model_name=name, api_key=api_key,
          max_request_bytes=args.max_request_bytes, default_max_tokens=args.default_max_tokens or None,
          max_queue=args.max_queue, request_timeout=args.request_timeout or None,
          graceful_timeout=args.graceful_timeout, log_level=args.log_level, parallel=parallel,
          step_tokens=args.step_tokens, allow_local_images=args.allow_local_images, **spec)
    return 0


def _default_parallel(model, spec: dict, args) -> int:
    """--parallel when not given: 1 with speculative decoding (single-stream) or on a backend without a batched
    step (the reference, Metal expert streaming: rows would run one by one, and Metal would lose its pipelined
    decode loop); else the most sessions of 8192 tokens that fit beside the weights in the memory budget
    (`expert_streaming.default_parallel`: at most 8 and the backend's rows per batched step, at least 1)."""
    if spec or model.max_batch_rows is None:
        return 1
    info = model.backend_info()
    return expert_streaming.default_parallel(
        model.config, model.weights, _load_options(args).get("memory_budget", "auto"),
        limit=model.max_batch_rows, kv_dtype=info.get("kv_dtype") or "bfloat16",
        backend="metal" if model.backend.startswith("metal") else "cpu")


def _either(args, positional: str, option: str):
    """The value given as the positional argument or as --option (exactly one of them)."""
    a, b = getattr(args, positional), getattr(args, option)
    if (a is None) == (b is None):
        raise InputError(f"give {positional.upper()} or --{option} (exactly one)", param=option)
    return a if a is not None else b


def cmd_convert(args) -> int:
    src, dst = _either(args, "src", "model"), _either(args, "dst", "out")
    if args.no_quantize and args.expert_bits is not None:
        raise InputError("--expert-bits needs quantization (drop --no-quantize)", param="expert_bits")
    t = time.perf_counter()
    out = convert(src, dst, revision=args.revision, q_bits=None if args.no_quantize else args.q_bits,
                  keep_mtp=args.keep_mtp, drop_vision=args.drop_vision, q_group_size=args.q_group_size,
                  expert_bits=args.expert_bits,
                  max_shard_bytes=int(args.max_shard_gb * 2**30), progress=not args.quiet)
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {out} ({size / 2**20:.1f} MiB of weights) in {time.perf_counter() - t:.1f} s")
    return 0


def cmd_compare(args) -> int:
    return compare.main_args(args)


def cmd_bench(args) -> int:
    return bench.main_args(args)


def cmd_selftest(args) -> int:
    return selftest.main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qwenmetal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"qwenmetal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="generate from a tiny offline checkpoint (or --model)")
    _add_model_args(p)
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=seed_arg, default=0)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("info", help="describe a checkpoint: config, sizes, memory estimate")
    _add_model_args(p, required=True)
    p.add_argument("--bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="a directory with only config.json: size it at this width (default: its quantization, else 4)")
    p.add_argument("--expert-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="a directory with only config.json: the routed experts' width (default: --bits)")
    p.add_argument("--hit-rate", type=float, default=None, help="also show the SSD bytes per token at this expert "
                   "cache hit rate (0..1)")
    g = p.add_argument_group("the Metal backends' memory plan against the GPU's working set (docs/metal.md)")
    g.add_argument("--mac-memory", default=None, metavar="SIZE",
                   help="plan for a Mac with this much memory (e.g. 32GiB; its working set is modelled)")
    g.add_argument("--working-set", default=None, metavar="SIZE",
                   help="plan for this recommendedMaxWorkingSetSize (e.g. 21.3GiB)")
    g.add_argument("--context", type=int, default=32768, help="tokens of KV cache to plan for (default 32768)")
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="plan for N concurrent sessions of --context tokens: one session's KV cache (as allocated) "
                        "and GDN state, N of them, whether they fit the memory budget beside the weights, the most "
                        "that fit and the default a server would take; the expert and GPU plans keep N sessions free")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    _add_model_args(p, required=True)
    p.add_argument("--prompt", default=None, help="the prompt (default or '-': read stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--no-thinking", action="store_true", help="enable_thinking=false in the chat template")
    p.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                   help="at most N tokens of thinking, then the think block is closed and the answer follows")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="the output is one JSON value of this JSON Schema (a file, or the schema's JSON text); with "
                        "--chat, the answer after any thinking (docs/structured-output.md)")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image file (PNG, JPEG, WebP, GIF) for a checkpoint with a vision tower; repeat for more. "
                   "With --chat it goes before the prompt in the user message; without, the prompt holds one "
                   "<|vision_start|><|image_pad|><|vision_end|> per image")
    p.add_argument("--quiet", action="store_true", help="no statistics line on stderr")
    _add_speculative_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with history (/help for commands)")
    _add_model_args(p, required=True)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--no-thinking", action="store_true", help="enable_thinking=false in the chat template")
    p.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                   help="at most N tokens of thinking, then the think block is closed and the answer follows")
    p.add_argument("--hide-thinking", action="store_true", help="do not print the reasoning")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image file for the first message (repeatable; /image PATH attaches one later)")
    p.add_argument("--verbose", action="store_true", help="statistics after every reply")
    _add_speculative_args(p)
    _add_sampling_args(p, max_tokens=4096)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the [server] extra)")
    _add_model_args(p, required=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set QWENMETAL_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the --model value "
                   "for a hub id, the directory name for a path)")
    p.add_argument("--max-request-bytes", type=int, default=server.DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413")
    p.add_argument("--default-max-tokens", type=int, default=server.DEFAULT_CHAT_MAX_TOKENS,
                   help=f"max_tokens when a chat request sets none (default {server.DEFAULT_CHAT_MAX_TOKENS}; "
                   "0: up to the context limit)")
    p.add_argument("--max-queue", type=int, default=server.DEFAULT_MAX_QUEUE,
                   help=f"requests waiting beyond this get 503 with Retry-After (default {server.DEFAULT_MAX_QUEUE})")
    p.add_argument("--request-timeout", type=float, default=server.DEFAULT_REQUEST_TIMEOUT,
                   help="seconds a generation may run; then it ends with finish_reason 'length' and what it "
                   f"generated (default {server.DEFAULT_REQUEST_TIMEOUT:g}; 0: no limit)")
    p.add_argument("--graceful-timeout", type=float, default=server.DEFAULT_GRACEFUL_TIMEOUT,
                   help="on shutdown, seconds in-flight requests get to finish before they are cancelled "
                   f"(default {server.DEFAULT_GRACEFUL_TIMEOUT:g})")
    p.add_argument("--cache-bytes", type=bytes_arg, default=None, help="prefix cache budget in bytes (0 disables)")
    p.add_argument("--cache-dir", nargs="?", const=str(cache_dir("prompt-cache")), default=None, metavar="DIR",
                   help="also keep chat turns' states on disk in DIR (default DIR: "
                        f"{cache_dir('prompt-cache')}), so a restarted server continues conversations cached")
    p.add_argument("--cache-dir-bytes", type=bytes_arg, default=None, metavar="BYTES",
                   help="disk budget of --cache-dir (default 4 GiB; least recently used files removed)")
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="requests generated at once, batched: one decode step runs all of them and reads the "
                   "weights once (default: the most sessions of 8192 tokens that fit the memory budget beside "
                   "the weights, at most 8; 1 with --speculative, which is single-stream)")
    p.add_argument("--step-tokens", type=int, default=server.DEFAULT_STEP_TOKENS, metavar="N",
                   help="prompt tokens prefilled per batched step between decode steps (default "
                   f"{server.DEFAULT_STEP_TOKENS}; rounded to the backend's prefill chunk)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--allow-local-images", action="store_true",
                   help="chat requests may name image files on this machine (a file:// URL or a path); without it "
                   "only data: URLs are taken. The server never fetches http(s) URLs")
    _add_speculative_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("convert", help="HF bf16 checkpoint -> MLX layout, 4-bit (as mlx_lm.convert -q)")
    p.add_argument("src", nargs="?", help="Hugging Face checkpoint directory or hub id (or --model)")
    p.add_argument("dst", nargs="?", help="output directory (or --out)")
    p.add_argument("--model", help="Hugging Face checkpoint directory or hub id")
    p.add_argument("--revision", default=None)
    p.add_argument("--out", help="output directory (must not exist or be empty)")
    p.add_argument("--q-bits", "--bits", dest="q_bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8])
    p.add_argument("--expert-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="routed experts' width (default: --q-bits); config.json records it per expert stack")
    p.add_argument("--q-group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--no-quantize", action="store_true", help="keep the weights unquantized (mlx_lm.convert without -q)")
    p.add_argument("--keep-mtp", action="store_true",
                   help="keep the MTP head (mtp.*), quantized like the body, for --speculative mtp")
    p.add_argument("--drop-vision", action="store_true",
                   help="drop the vision tower (kept by default, unquantized, as mlx-vlm's vision_tower.*): "
                        "a text-only checkpoint, as mlx_lm.convert writes it")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of at most this size")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("bench", help="prefill/decode speed on a random real-width checkpoint (docs/benchmarks.md)")
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("compare", help="qwenmetal beside mlx-lm and llama.cpp: speed plots, agreement, perplexity "
                       "(docs/benchmarks.md)")
    compare.add_arguments(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("selftest", help="check the Metal backend on this device (kernels, graph); a report to paste")
    p.add_argument("--sim", action="store_true", help="run on the Metal-on-CPU simulator even on a Mac")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the whole report as JSON (schema qwenmetal-selftest/1) to attach to an issue "
                        "(docs/mac-first-run.md)")
    p.set_defaults(func=cmd_selftest)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, MemoryError, OSError) as e:   # OSError names the path (e.g. --cache-dir)
        print(f"qwenmetal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:          # Ctrl-C in any command: one line, no traceback, 128 + SIGINT
        if sys.stdout.isatty():
            print(flush=True)          # end a partly written line of output
        print("qwenmetal: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
