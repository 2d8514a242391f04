"""`Model`: a checkpoint loaded on one backend, with generation, chat and the caches.

    model = Model.load(path_or_hub_id, backend="reference")
    s = model.new_session()
    logits = model.prefill(s, ids, return_logits="last")     # float32 [vocab]
    logits = model.decode_step(s, token_id)
    for out in model.generate("Hello", max_tokens=32): print(out.text, end="")

The primitive calls and `Session` are `qwenmetal.session`'s; generation, speculative decoding, chat and the
prefix cache are the runtime modules below this one (docs/architecture.md).
"""
from __future__ import annotations

import os
import threading
from html import escape
from typing import Iterator, Sequence

from . import batching, generation
from .backends import backend_factory
from .chat import ChatResponse, chat_turn, read_images
from .config import ModelConfig
from .generation import GenerationOutput
from .grammar import Grammar
from .options import GenerationOptions
from .paths import resolve_checkpoint
from .prefix_cache import PrefixCache
from .sampling import Sampler
from .session import ModelBase, Session
from .tokenizer import load_tokenizer
from .transcripts import (
    TranscriptStore,
    chat_prompt,
    conversation_session,
    restore_from_disk,
    resume_conversation,
)
from .weights import load_weights

__all__ = ["Model"]


class Model(ModelBase):
    """A loaded checkpoint on one backend: the primitive calls (`qwenmetal.session.ModelBase`), generation,
    chat and the caches."""

    def __init__(self, config: ModelConfig, weights, tokenizer, backend, path: str):
        super().__init__(config, weights, tokenizer, backend, path)
        # a backend whose prefill runs in fixed chunks (metal, metal-sim) snapshots at its chunk boundaries:
        # the state there is what one of its command buffers left, so a resume re-runs whole chunks
        chunk = self.snapshot_chunk
        self.prefix_cache: PrefixCache | None = PrefixCache() if chunk is None else PrefixCache(chunk_tokens=chunk)
        self.transcripts: TranscriptStore | None = TranscriptStore()

    @classmethod
    def load(cls, path_or_id: str | os.PathLike, backend: str = "auto", *, revision: str | None = None,
             **options) -> "Model":
        """Load a checkpoint (local directory or hub id) onto a backend.

        backend: "cpu" (C++ engine on the mmap'd weights, threads + SIMD), "reference" (numpy,
        float32 on dequantized weights) or "auto" (the fastest available here: cpu, then reference).
        Other keyword options go to the backend — cpu: threads (default: physical cores), kv_dtype
        ("bfloat16" | "float32"), prefill_chunk (tokens per chunk, default 512), quantize (None | 4 | 8:
        quantize a dense checkpoint at load, group 64), memory_budget ("auto" (default: the memory
        available here) | bytes | a size like "8GiB" | None: never stream; a checkpoint larger than the
        budget keeps its non-expert weights mapped and streams the routed experts from the files into a
        bounded expert cache, output unchanged), expert_slots (cache slots per MoE layer, 1..num_experts;
        giving it forces streaming), expert_policy ("lfu", the default | "lru" | "os") and expert_direct_io
        (read the experts past the page cache, default False); reference: dtype
        ("float32" | "bfloat16", rounding where MLX rounds), gdn_mode ("chunked" | "recurrent"), chunk_size
        (GDN prefill chunk, default 64); metal / metal-sim: dtype, kv_dtype, attention, prefill_chunk (tokens per GPU chunk,
        default 4096; the prefix cache snapshots at its boundaries), gemm_route ("auto" | "simdgroup" |
        "tensor"), gdn_route ("auto" | "scan" | "chunked"), max_context (the context the GPU memory plan
        reserves KV for, default 32768: resident, a smaller chunk or expert streaming within the GPU's working
        set), command_buffer_seconds (modelled GPU time each prefill command buffer is cut to), and
        memory_budget / expert_slots / expert_policy as on cpu (slots in device buffers, per-layer command
        buffers); metal-sim also schedule, seed and device_options (SimDevice's modelled Mac limits:
        pipeline_max_threads, working_set, watchdog_seconds); see `qwenmetal.backends.metal`.
        """
        factory = backend_factory(backend)
        path = resolve_checkpoint(path_or_id, revision)
        config = ModelConfig.from_file(path)
        weights = load_weights(path, config)
        tokenizer = load_tokenizer(path)
        impl = factory(weights, **options)
        return cls(config, weights, tokenizer, impl, path)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = None, *,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
                 logprobs: bool | None = None, top_logprobs: int | None = None,
                 skip_special_tokens: bool | None = None, grammar: Grammar | None = None,
                 thinking_budget: int | None = None, options: GenerationOptions | None = None,
                 sampler: Sampler | None = None, session: Session | None = None, cache: bool = True,
                 cache_points: Sequence[int] = (), progress: bool | None = None,
                 cancel: threading.Event | None = None, speculative=None,
                 speculative_k: int | None = None, images=None) -> Iterator[GenerationOutput]:
        """Stream `GenerationOutput`s for `prompt` (text, encoded without a chat template, or token ids).

        The sampling and stopping options (max_tokens, default 256, temperature ... skip_special_tokens) are
        the fields of `qm.GenerationOptions`: pass them as keywords, or `options=` one (keywords given too
        replace its fields). Sampling parameters left unset come from generation_config.json (greedy when
        temperature is 0); or `sampler=` a `qm.Sampler` instead of them (passing both is an error). Stops
        at an eos id (config.json, generation_config.json, the tokenizer's eos, `<|im_end|>`; `ignore_eos`
        disables them), an id in `stop_token_ids`, a `stop` string (matched across tokens, not emitted),
        after `max_tokens`, or when the session is full. With `session`, continues it (the prompt is
        appended; the last sampled token is not fed back); otherwise uses a new session and the prefix
        cache (`cache=False` to bypass; `cache_points`: prompt lengths to keep a snapshot at). `cancel`: an
        Event that ends the generation (no final output). The last output has `finish_reason` and `stats`.
        `speculative`: decode speculatively with a drafter -- "lookup" (n-grams of the session's own tokens),
        "mtp" (the checkpoint's multi-token-prediction head), a draft `Model` of the same vocabulary, or a
        `qwenmetal.speculative.Drafter`; the output is exactly what decoding without it gives (greedy: the
        same tokens; sampling: the same distribution), and `stats["speculative"]` reports drafted and
        accepted tokens. `speculative_k`: drafts per round (default: chosen from the measured acceptance
        and cost, 0 when speculation does not pay). See docs/speculative.md.
        `images`: the images of the prompt, in order (paths, bytes, ``data:image/...;base64`` URLs, PIL images,
        uint8 [H, W, 3] arrays), one per ``<|image_pad|>`` placeholder the prompt holds (write
        ``<|vision_start|><|image_pad|><|vision_end|>`` where each goes); each is expanded to its image's tokens
        and read by the checkpoint's vision tower (docs/vision.md). Not with `speculative`.
        `grammar`: a `qm.Grammar` (``Grammar.json_schema(schema)``, ``Grammar.regex(...)``,
        ``Grammar.lark(...)``) that every generated token keeps the text within (docs/structured-output.md).
        `thinking_budget`: at most this many tokens of thinking when the prompt opens a think block (a chat
        turn with thinking on); then a short note and ``</think>`` are forced and the answer follows.
        Arguments are checked before the first output: invalid ones raise ValueError naming them.
        See docs/usage.md.
        """
        opts = GenerationOptions.build(
            options, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs,
            skip_special_tokens=skip_special_tokens, grammar=grammar, thinking_budget=thinking_budget)
        return generation.generate(self, prompt, opts, sampler=sampler, session=session, cache=cache,
                        cache_points=cache_points, progress=progress, cancel=cancel, speculative=speculative,
                        speculative_k=speculative_k, images=images)

    def generate_batch(self, prompts: Sequence, max_tokens: int | None = None, *,
                       options: GenerationOptions | Sequence[GenerationOptions] | None = None,
                       max_rows: int | None = None, step_tokens: int = batching.DEFAULT_STEP_TOKENS,
                       cache: bool = True, cancel: threading.Event | None = None,
                       **option_kwargs) -> Iterator[tuple[int, GenerationOutput]]:
        """Generate for several prompts at once: yields ``(index, GenerationOutput)`` for each prompt's outputs
        as they come (each prompt's last output has `finish_reason` and `stats`).

        The options are `generate`'s (max_tokens, temperature, ..., seed, stop, logprobs; see
        `qm.GenerationOptions`): keywords apply to every prompt; `options=` is one `GenerationOptions` or one
        per prompt (keywords given too replace their fields). Every prompt's output is what `generate` gives
        for it alone on the host path (greedy and seeded sampling: the same tokens). Up to `max_rows` prompts
        (default: the backend's limit, 32 on cpu) decode together, one token each per step, in one forward
        that reads the weights once for all of them; the others wait for a free row. New prompts are prefilled
        in pieces between decode steps, at most `step_tokens` tokens per step. Speculative decoding is
        single-stream only (`generate`). See `qwenmetal.batching` and docs/usage.md."""
        prompts = list(prompts)
        if option_kwargs or max_tokens is not None:
            extra = dict(option_kwargs, **({} if max_tokens is None else {"max_tokens": max_tokens}))
            if options is None or isinstance(options, GenerationOptions):
                options = GenerationOptions.build(options, **extra)
            else:
                options = [GenerationOptions.build(o, **extra) for o in options]
        return batching.generate_batch(self, prompts, options, max_rows=max_rows, step_tokens=step_tokens,
                                       cache=cache, cancel=cancel)

    def chat_prompt(self, messages: Sequence[dict], *, tools: list | None = None,
                    enable_thinking: bool | None = None, **template_kwargs) -> tuple[list, int, str]:
        """(prompt ids, number of ids before the generation prompt, prompt text) for `messages` as given
        (`Model.chat` checks them first; see `qwenmetal.chat.chat_turn`): the transcript of the longest
        answered prefix of the conversation plus the rendering of the rest, or the template's rendering
        (see `qwenmetal.transcripts`)."""
        p = chat_prompt(self, messages, tools=tools, enable_thinking=enable_thinking, **template_kwargs)
        return p.ids, p.head, p.text

    def use_disk_cache(self, directory: str | os.PathLike, max_bytes: int | None = None) -> None:
        """Keep the state at the end of every chat turn that has a transcript in `directory` as well (a
        session file per turn, at most `max_bytes`, default 4 GiB, least recently used removed), and read
        the ones already there, so a new process -- a restarted server -- continues those conversations
        without prefilling them. See `qwenmetal.prefix_cache.DiskTier`."""
        if self.prefix_cache is None:
            raise ValueError("the prefix cache is off (model.prefix_cache is None): nothing to keep on disk")
        self.prefix_cache.attach_disk(self, directory, max_bytes)
        restore_from_disk(self)

    def chat_session(self, messages: Sequence[dict], *, tools: list | None = None,
                     enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None) -> Session:
        """A new session holding the conversation `messages` as the model read and wrote it (the transcript
        of its last reply, else its rendering), with the messages in ``metadata``: `Session.save` it, and
        `Session.load` continues it. Uses the prefix cache, so after `chat` it prefills at most one token.
        Image parts are read as `chat` reads them; the metadata names them by their content hash."""
        msgs, batch = read_images(self, [dict(m) for m in messages])
        return conversation_session(self, msgs, tools=tools, enable_thinking=enable_thinking, images=batch,
                                    **(chat_template_kwargs or {}))

    def chat(self, messages: Sequence[dict], *, tools: list | None = None, enable_thinking: bool | None = None,
             stream: bool = False, chat_template_kwargs: dict | None = None, tool_choice=None,
             response_format: dict | None = None, parallel_tool_calls: bool = True,
             options: GenerationOptions | None = None, **generate_kwargs) -> ChatResponse | Iterator[GenerationOutput]:
        """Answer a conversation (OpenAI-style message dicts) with the checkpoint's chat template.

        The messages are checked as the server checks them (`qwenmetal.chat.validate_messages`: ValueError
        naming ``messages[i]``). Returns a `ChatResponse` (content, reasoning, tool_calls -- parsed when
        `tools` are offered --, finish_reason, stats, `.message` to append to the history), or with
        `stream=True` the `GenerationOutput` iterator. Uses the prefix cache, and keeps the reply's tokens
        (a transcript, `qwenmetal.transcripts`) so that the next turn's prompt continues them and prefills
        only the new messages. `options` and the other keyword arguments are `generate`'s (max_tokens,
        temperature, stop, seed, sampler, ...). Tool calls follow the tools' schemas; `tool_choice`
        ("auto", "none", "required", or a function), `parallel_tool_calls` and `response_format`
        (``{"type": "json_schema", "json_schema": {"schema": ...}}``, ``{"type": "json_object"}``) are
        OpenAI's (docs/structured-output.md).
        """
        turn = chat_turn(self, messages, tools=tools, enable_thinking=enable_thinking,
                         template_kwargs=chat_template_kwargs, tool_choice=tool_choice,
                         response_format=response_format, parallel_tool_calls=parallel_tool_calls)
        gen = turn.generate(self, options, **generate_kwargs)
        if stream:
            return turn.remembering(self, gen)
        r = turn.response(gen)
        turn.remember(self, r.message, r.tokens)
        return r

    def session_loaded(self, session: Session) -> None:
        """A loaded session holding a conversation goes into the prefix cache with its transcript."""
        resume_conversation(self, session)

    def _experts_streamed(self) -> str | None:
        """How the routed experts are read when they are streamed from disk, else None."""
        e = self.backend_info().get("experts")
        if isinstance(e, dict) and e.get("streaming"):
            return f"streamed from disk ({e.get('slots_per_layer')} slots per layer, {e.get('policy')})"
        return None

    def __repr__(self) -> str:
        streamed = self._experts_streamed()
        experts = f", experts={streamed!r}" if streamed else ""
        return (f"Model(backend={self.backend!r}, path={self.path!r}, layout={self.weights.layout!r}, "
                f"weights={self.weights.nbytes / 2**20:.1f} MiB{experts},\n      {self.config!r})")

    def _repr_html_(self) -> str:
        c = self.config
        rows = [("backend", self.backend), ("path", self.path), ("layout", self.weights.layout),
                ("weights", f"{self.weights.nbytes / 2**20:.1f} MiB"),
                ("experts", self._experts_streamed() or "resident"),
                ("layers", f"{c.num_hidden_layers} ({len(c.linear_attention_layers)} Gated DeltaNet, "
                           f"{len(c.full_attention_layers)} attention)"),
                ("tokenizer", repr(self.tokenizer)), ("prefix cache", repr(self.prefix_cache))]
        body = "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in rows)
        return f"<b>qwenmetal.Model</b><table>{body}</table>" + c._repr_html_()
