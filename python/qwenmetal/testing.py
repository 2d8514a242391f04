"""Deterministic tiny checkpoints in the real on-disk formats, for tests and demos.

``make_checkpoint(dir, config="tiny", format="mlx-q4", seed=0)`` writes a complete checkpoint directory:

* ``"hf-bf16"``  -- what transformers' ``save_pretrained`` writes: for ``qwen3_5_moe`` (nested
  ``text_config``) the ``Qwen3_5MoeForConditionalGeneration`` layout (``model.language_model.*``,
  ``lm_head.weight``, ``model.visual.*`` when the config has a ``vision_config``), for
  ``qwen3_5_moe_text`` the ``Qwen3_5MoeForCausalLM`` layout (``model.layers.*``), both with fused experts
  (``save_original_format=False``); for ``qwen3_next`` the ``Qwen3NextForCausalLM`` layout (fused
  ``in_proj_qkvz``/``in_proj_ba``, per-expert keys). bf16, except ``A_log`` which is float32 as in
  Qwen's own releases. Norms are zero-centred (the model applies ``1 + w``).
* ``"mlx-bf16"`` -- what ``mlx_lm.convert`` writes from that HF checkpoint: sanitized keys, experts
  stacked into ``switch_mlp``, conv1d ``[C, K, 1]``, ``bf16(1 + w)`` norms.
* ``"mlx-q4"`` / ``"mlx-q8"`` (and ``"mlx-q2"``, ``"mlx-q3"``, ``"mlx-q5"``, ``"mlx-q6"``) --
  ``mlx_lm.convert -q --q-bits B --q-group-size 64``: every Linear / Embedding / SwitchLinear with an
  input dim divisible by 64 affine-quantized (uint32 weights, scales and biases in the weight dtype),
  router ``mlp.gate`` and ``mlp.shared_expert_gate`` at 8 bits, the ``quantization`` block (+ per-path
  overrides) in config.json, duplicated as ``quantization_config``.
* ``"mlx-q4-e2"`` / ``"mlx-q4-e3"`` -- the same at 4 bits with the routed experts (``switch_mlp.*``) at
  2 / 3 bits: ``mlx_lm.convert(..., quant_predicate=...)`` with the model's predicate plus that rule;
  config.json gets a ``{"group_size": 64, "bits": B, "mode": "affine"}`` entry per expert stack.

mlx-lm has no ``qwen3_5_moe_text`` model: for that model type the MLX formats wrap the text config the way
the real multimodal checkpoint does (``{"model_type": "qwen3_5_moe", "text_config": {...}}``) -- the
result is what ``mlx_lm.convert`` makes of the same weights under the nested config.

Every format also gets ``tokenizer.json`` (a byte-level BPE trained here on a built-in corpus, with the
Qwen pre-tokenizer and the real special tokens), ``tokenizer_config.json`` (with the chat template and
``added_tokens_decoder``), ``chat_template.jinja`` and ``generation_config.json``.

The weights and the writing are :mod:`qwenmetal.checkpoint_writer`'s (the one random-checkpoint writer,
also behind the benchmark's real-width checkpoint and ``testing.random_params``): drawn from ``seed``
per tensor name, in float32, then rounded to bf16, so the same seed is the same logical model in every
format (mlx-q4 is the quantization of exactly the hf-bf16 weights); streamed shard by shard. Same
arguments -> byte-identical files. The directory appears atomically (``fileio.atomic_dir``), so a
half-written one is never mistaken for a checkpoint and an error leaves nothing behind.

``mtp=True`` (``make_checkpoint``, ``cached_checkpoint``, ``hf_tensors``, ``mlx_tensors``) adds a random
multi-token-prediction head (``mtp.*``, docs/model.md §2.5: ``mtp.fc.weight`` [H, 2H], the zero-centred
``mtp.pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm``, ``mtp.layers.0.*`` a full-attention MoE
layer) and ``mtp_num_hidden_layers: 1`` to config.json; the MLX formats then keep it (as ``qwenmetal convert
--keep-mtp`` does). Off by default: the fixtures without it are unchanged, byte for byte.

Verified against the real tools in ``tests/test_fixtures.py``.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from . import checkpoint_writer as _writer
from . import convert as _convert
from .config import ModelConfig
from .paths import cache_dir

__all__ = ["PRESETS", "FORMATS", "SPECIAL_TOKENS", "BPE_VOCAB_SIZE", "CHAT_TEMPLATE",
           "make_checkpoint", "cached_checkpoint", "checkpoint_key", "hf_tensors", "mlx_tensors",
           "build_tokenizer", "wrap_text_config"]

FORMATS = _writer.LAYOUTS
FIXTURE_VERSION = 2          # bump when generated content changes (invalidates cached_checkpoint)
#                              2: the chat template renders image parts (<|vision_start|><|image_pad|><|vision_end|>)

# --------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------
BPE_VOCAB_SIZE = 400         # 256 byte symbols + 144 merges; the added tokens follow
# (content, special) in id order, a subset of Qwen's in Qwen's order
_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
SPECIAL_TOKENS = {tok: BPE_VOCAB_SIZE + i for i, (tok, _) in enumerate(_ADDED_TOKENS)}
ENDOFTEXT, IM_START, IM_END = SPECIAL_TOKENS["<|endoftext|>"], SPECIAL_TOKENS["<|im_start|>"], SPECIAL_TOKENS["<|im_end|>"]

# Qwen3.5 (HF Qwen3_5Tokenizer) and Qwen2/Qwen3/Qwen3-Next (Qwen2Tokenizer) pre-tokenizer regexes
_QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the model thinks about the next token.
A hybrid model mixes gated delta networks with full attention every fourth layer.
Each token picks two of eight experts, and a shared expert always runs beside them.
Weights are stored as four-bit integers with one scale and one bias for every group of sixty-four.
The scale may be negative; the bias is the value at the edge of the group.
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
<think>
The user asks about geography. Paris is the capital.
</think>

The capital of France is Paris.<|im_end|>
def forward(self, x):
    h = self.norm(x)
    return x + self.mixer(h)
for i in range(10):
    print(i * i, "squared")
if (a > b) { return a - b; } else { return b - a; }
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1234 3.14159 2026-01-01 100%
Ünïcödé tëxt: café, naïve, façade, Straße, Ærø, smörgåsbord, crème brûlée.
Greek: αβγ δέλτα; Cyrillic: привет мир; Hebrew: שלום; Arabic: مرحبا
中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요.
Emoji: 🙂 👍🏽 👨‍👩‍👧 🚀 — and symbols: ©®™ ±×÷ ≤≥ ∑∫ → ←
She said "it's fine", we'll see; they're here, I'm there, you've won, he'd go.
<tool_call>
<function=get_weather>
<parameter=city>
Berlin
</parameter>
</function>
</tool_call>
<tool_response>
{"temperature": 21, "unit": "celsius"}
</tool_response>
   indented line with    several   spaces	and a tab
The end of the corpus; the end of the story. The end.
"""

# A compact Qwen3.5-style chat template (docs/model.md §8.3): optional system turn (with the XML tool-call
# instructions when tools are given), trimmed user turns (an image part as Qwen's templates write it:
# <|vision_start|><|image_pad|><|vision_end|>), assistant turns with a <think> block only after
# the last real user query (or with preserve_thinking), XML tool calls, grouped tool responses, and the
# generation prompt "<|im_start|>assistant\n<think>\n" (or an empty think block if enable_thinking=false).
CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part is mapping and part.type == 'text' -%}{{- part.text -}}
            {%- elif part is mapping and (part.type == 'image' or 'image' in part or 'image_url' in part) -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content | string -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}
    {{- raise_exception('No messages provided.') -}}
{%- endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools is defined and tools -%}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format\n- Required parameters MUST be specified\n- Reasoning about a call may come BEFORE the call, never after it\n- Without a suitable function, answer normally\n</IMPORTANT>' -}}
    {%- if has_system -%}
        {%- set sys = text_of(messages[0].content) | trim -%}
        {%- if sys -%}
            {{- '\n\n' ~ sys -}}
        {%- endif -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' ~ (text_of(messages[0].content) | trim) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {%- set c = text_of(m.content) | trim -%}
        {%- if not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) -%}
            {%- set ns.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if ns.last_query < 0 -%}
    {{- raise_exception('No user query found in messages.') -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set content = text_of(m.content) -%}
    {%- if m.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('The system message must come first.') -}}
        {%- endif -%}
    {%- elif m.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ (content | trim) ~ '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set content = content | trim -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query or preserve_thinking is true -%}
            {{- '<think>\n' ~ (reasoning | trim) ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if m.tool_calls -%}
            {%- for call in m.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '\n' -}}
                {%- elif content -%}
                    {{- '\n\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n<function=' ~ fn.name ~ '>\n' -}}
                {%- if fn.arguments is mapping -%}
                    {%- for key, value in fn.arguments | items -%}
                        {{- '<parameter=' ~ key ~ '>\n' -}}
                        {%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif fn.arguments is string -%}
                    {{- fn.arguments ~ '\n' -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role: ' ~ m.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""


_family = _convert.family


@functools.lru_cache(maxsize=None)
def _tokenizer_json(family: str) -> str:

    regex = _QWEN2_REGEX if family == "qwen3_next" else _QWEN35_REGEX

    def pipeline(tok):
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        return tok

    trainer_tok = pipeline(Tokenizer(models.BPE(unk_token=None)))
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab, merges = trained["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                       for m in trained["merges"]]
    if len(vocab) != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {len(vocab)} tokens, expected {BPE_VOCAB_SIZE}")
    # the same model with the settings transformers' Qwen tokenizers use (so a save_pretrained round
    # trip, as mlx_lm.convert does, rewrites the file unchanged)
    tok = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, dropout=None,
                                        continuing_subword_prefix="", end_of_word_suffix="",
                                        fuse_unk=False, byte_fallback=False)))
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    for content, special in _ADDED_TOKENS:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    if tok.get_vocab_size() != BPE_VOCAB_SIZE + len(_ADDED_TOKENS) or \
            tok.token_to_id("<|endoftext|>") != ENDOFTEXT or tok.token_to_id("</think>") != SPECIAL_TOKENS["</think>"]:
        raise RuntimeError("unexpected tokenizer ids")
    return tok.to_str(pretty=True)


def build_tokenizer(config: str | Mapping[str, Any] = "tiny"):
    """The fixture tokenizer (a ``tokenizers.Tokenizer``) for a preset name or config dict."""
    return Tokenizer.from_str(_tokenizer_json(_family(_resolve_config(config))))


def _tokenizer_config(family: str) -> dict:
    decoder = {}
    for content, special in _ADDED_TOKENS:
        decoder[str(SPECIAL_TOKENS[content])] = {"content": content, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": special}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer" if family == "qwen3_next" else "Qwen3_5Tokenizer",
        "unk_token": None,
    }


def _generation_config() -> dict:
    return {"bos_token_id": ENDOFTEXT, "do_sample": True, "eos_token_id": [IM_END, ENDOFTEXT],
            "pad_token_id": ENDOFTEXT, "temperature": 1.0, "top_k": 20, "top_p": 0.95}


# --------------------------------------------------------------------------------------------------
# presets (config.json dicts, in the schema transformers 5 writes them)
# --------------------------------------------------------------------------------------------------
def _text_config(model_type: str, **extra) -> dict:
    d = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": ENDOFTEXT,
        "full_attention_interval": 4,      # mlx-lm reads this (and ignores layer_types)
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "max_position_embeddings": 4096,
        "model_type": model_type,
        "moe_intermediate_size": 64,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 512,
    }
    d.update(extra)
    return dict(sorted(d.items()))


def _presets() -> dict:
    text = _text_config("qwen3_5_moe_text")
    nested_text = dict(text)
    tiny = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "dtype": "bfloat16",
        "image_token_id": SPECIAL_TOKENS["<|image_pad|>"],
        "model_type": "qwen3_5_moe",
        "text_config": nested_text,
        "tie_word_embeddings": False,
        "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
        "vision_config": {
            "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "in_channels": 3,
            "initializer_range": 0.02, "intermediate_size": 64, "model_type": "qwen3_5_moe_vision",
            "num_heads": 2, "num_position_embeddings": 64, "out_hidden_size": 128, "patch_size": 16,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}, "spatial_merge_size": 2,
            "temporal_patch_size": 2},
        "vision_end_token_id": SPECIAL_TOKENS["<|vision_end|>"],
        "vision_start_token_id": SPECIAL_TOKENS["<|vision_start|>"],
    }
    tiny_text = dict(text, architectures=["Qwen3_5MoeForCausalLM"], dtype="bfloat16")
    nxt = _text_config(
        "qwen3_next", architectures=["Qwen3NextForCausalLM"], dtype="bfloat16", eos_token_id=IM_END,
        decoder_sparse_step=1, intermediate_size=128, mlp_only_layers=[], norm_topk_prob=True,
        rope_parameters={"partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
        # mlx-lm's qwen3_next ModelArgs requires these two at the top level (transformers 5 nests them)
        rope_theta=10000000.0, partial_rotary_factor=0.25)
    # the same model with a tower worth testing: 2 blocks, 4 heads of 16, a 6 x 6 learned position grid (so
    # every image grid is an interpolation of it), the real patch / merge / temporal sizes
    tiny_vl = dict(tiny, vision_config=dict(
        tiny["vision_config"], depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_position_embeddings=36))
    return {"tiny": tiny, "tiny-text": dict(sorted(tiny_text.items())), "tiny-qwen3-next": nxt, "tiny-vl": tiny_vl}


#: Preset name -> config.json dict. ``tiny``: Qwen3.5/3.6-MoE as released (``qwen3_5_moe`` with a nested
#: ``text_config`` and a tiny vision config); ``tiny-text``: the same text model as transformers'
#: ``Qwen3_5MoeForCausalLM`` saves it (``qwen3_5_moe_text``); ``tiny-qwen3-next``: Qwen3-Next; ``tiny-vl``:
#: ``tiny`` with a larger vision tower (2 blocks, hidden 64 in 4 heads, MLP 128, a 6 x 6 position grid, patch
#: 16, merge 2) for the image tests -- with ``vision=True`` its MLX formats keep the tower (mlx-vlm's layout).
#: All: hidden 128, 4 layers (3 GDN + 1 attention), attention 4q/2kv x 32 (8 rotary dims, theta 1e7),
#: GDN 2k/4v heads x 32, conv 4, 8 experts top-2 x 64 + shared 64, vocab 512 (tokenizer: 414 ids).
#: Every linear's input dim is a multiple of 64, so 4-bit g64 quantization covers all of them.
PRESETS: dict[str, dict] = _presets()


def _resolve_config(config: str | Mapping[str, Any]) -> dict:
    if isinstance(config, str):
        try:
            return copy.deepcopy(PRESETS[config])
        except KeyError:
            raise ValueError(f"unknown preset {config!r}; presets: {sorted(PRESETS)}") from None
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a preset name or a config.json dict, not {type(config).__name__}")
    return json.loads(json.dumps(config))


# --------------------------------------------------------------------------------------------------
# weights and writing: qwenmetal.checkpoint_writer (the one random-checkpoint writer)
# --------------------------------------------------------------------------------------------------
def hf_tensors(config: str | Mapping[str, Any] = "tiny", seed: int = 0, *, mtp: bool = False) -> dict[str, np.ndarray]:
    """The tensors of the ``hf-bf16`` checkpoint, by file key (see the module docstring)."""
    return _writer.hf_tensors(_resolve_config(config), seed, mtp)


def mlx_tensors(config: str | Mapping[str, Any] = "tiny", format: str = "mlx-q4",
                seed: int = 0, *, mtp: bool = False, vision: bool = False) -> dict[str, np.ndarray]:
    """The tensors of an MLX-format checkpoint (``mlx-bf16`` / ``mlx-q4`` / ``mlx-q8``), by file key
    (``vision``: with the tower in mlx-vlm's layout)."""
    return _writer.mlx_tensors(_resolve_config(config), format, seed, mtp, vision)


wrap_text_config = _convert.wrap_text_config


def _side_files(cfg: dict) -> dict[str, str]:
    """The non-weight files every fixture format ships: generation config, tokenizer, chat template."""
    fam = _family(cfg)
    return {
        "generation_config.json": json.dumps(_generation_config(), indent=2, sort_keys=True) + "\n",
        "tokenizer.json": _tokenizer_json(fam),
        "tokenizer_config.json": json.dumps(_tokenizer_config(fam), indent=2, ensure_ascii=False) + "\n",
        "chat_template.jinja": CHAT_TEMPLATE,
    }


def make_checkpoint(dir: str | os.PathLike, config: str | Mapping[str, Any] = "tiny", format: str = "mlx-q4",
                    seed: int = 0, *, max_shard_bytes: int = _convert.MAX_SHARD_BYTES,
                    progress: bool = False, mtp: bool = False, vision: bool = False) -> Path:
    """Write a complete checkpoint directory at ``dir`` and return its path.

    ``config``: a :data:`PRESETS` name or a config.json dict (same schema as a real config.json);
    ``format``: one of :data:`FORMATS`. ``dir`` must not exist or be an empty directory. The weights are
    streamed into safetensors shards of at most ``max_shard_bytes`` (mlx-lm's 5 GiB by default); the
    checkpoint is built in a temporary sibling directory and renamed into place (nothing is left behind
    on an error). ``progress``: a tqdm bar of the bytes written. ``mtp``: with a random MTP head (see the
    module docstring). ``vision``: the MLX formats keep the vision tower in mlx-vlm's layout (``vision_tower.*``,
    unquantized, what ``qwenmetal convert`` writes by default; needs a config with a ``vision_config``, e.g.
    ``"tiny-vl"``); ``hf-bf16`` has the tower (``model.visual.*``) whenever the config has a vision_config.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; formats: {FORMATS}")
    cfg = _resolve_config(config)
    if mtp:
        cfg = _writer.with_mtp(cfg)
    c = ModelConfig.from_dict(cfg)
    _writer.check_supported(cfg, c)
    n_tok = BPE_VOCAB_SIZE + len(_ADDED_TOKENS)
    if c.vocab_size < n_tok:
        raise ValueError(f"vocab_size {c.vocab_size} is smaller than the fixture tokenizer ({n_tok} ids)")
    return _writer.write_checkpoint(dir, cfg, format, int(seed), files=_side_files(cfg),
                                    max_shard_bytes=max_shard_bytes, progress=progress, mtp=mtp,
                                    vision=vision)


def checkpoint_key(config: str | Mapping[str, Any], format: str, seed: int, mtp: bool = False,
                   vision: bool = False) -> str:
    """A short hash of everything a generated checkpoint's bytes depend on (config, format, seed, the
    generator's version, numpy and tokenizers, and ``mtp`` when set): the cache key of
    :func:`cached_checkpoint`."""

    d = {"config": _resolve_config(config), "format": format, "seed": int(seed),
         "version": FIXTURE_VERSION, "numpy": np.__version__, "tokenizers": tokenizers.__version__}
    if mtp:                                    # absent otherwise: the keys of existing fixtures stay
        d["mtp"] = True
    if vision:
        d["vision"] = True
    key = json.dumps(d, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cached_checkpoint(preset: str | Mapping[str, Any] = "tiny", format: str = "mlx-q4", seed: int = 0, *,
                      cache: str = "fixtures", name: str | None = None,
                      build: Callable[[Path, dict, str, int], Path] | None = None, mtp: bool = False,
                      vision: bool = False) -> Path:
    """``make_checkpoint`` once per :func:`checkpoint_key` under ``paths.cache_dir(cache)`` and return
    its path (``<name>-<format>-seed<seed>-<key>``; ``name`` defaults to the preset name or model_type,
    plus ``-mtp`` with ``mtp``, ``-vision`` with ``vision``). ``build(dest, cfg, format, seed)`` writes a missing
    one (default :func:`make_checkpoint`, with ``mtp`` and ``vision``); a checkpoint another process finished
    first is used as it is."""
    cfg = _resolve_config(preset)
    if name is None:
        name = preset if isinstance(preset, str) else cfg.get("model_type", "custom")
    flags = {}
    if mtp:
        cfg, name = _writer.with_mtp(cfg), name + "-mtp"
        flags["mtp"] = True
    if vision:
        name += "-vision"
        flags["vision"] = True
    if build is None and flags:
        build = functools.partial(make_checkpoint, **flags)
    dest = cache_dir(cache) / f"{name}-{format}-seed{int(seed)}-{checkpoint_key(cfg, format, seed, mtp, vision)}"
    if (dest / "config.json").is_file():
        return dest
    try:
        return (build or make_checkpoint)(dest, cfg, format, int(seed))
    except OSError:
        if (dest / "config.json").is_file():          # built concurrently by someone else
            return dest
        raise


# ---------------------------------------------------------------------------------------------
# random parameters for the numpy model
# ---------------------------------------------------------------------------------------------
def random_params(config: ModelConfig, seed: int = 0, dtype=np.float32) -> dict:
    """Random parameters with the canonical names and shapes for ``config``, as ``dtype``.

    Drawn by the random checkpoint writer (:func:`qwenmetal.checkpoint_writer.canonical_params`, the one
    source of random weights: same per-name generator and tensor list as every fixture checkpoint) with
    its ``"reference"`` scales: input-side projections ~ N(0, clip(1/sqrt(fan_in), 0.02, 0.1)), the
    residual-writing ones (``o_proj``, ``out_proj``, every ``down_proj``) ~ N(0, 0.02), embeddings ~
    N(0, 0.5), so that each layer adds a modest update to a residual stream that dominates, as in a
    trained pre-norm model (see ``checkpoint_writer.INITS`` for why); shifted norm weights and
    ``linear_attn.norm`` ~ 1 + N(0, 0.1); conv taps ~ N(0, 0.3); ``A_log = log(U(1, 8))``; ``dt_bias ~
    U(-1, 1)``; router ~ N(0, 0.3) so that routing is not uniform; ``shared_expert_gate`` ~ N(0, 0.1).
    """
    return {k: v.astype(dtype) for k, v in _writer.canonical_params(config, seed, "reference").items()}
