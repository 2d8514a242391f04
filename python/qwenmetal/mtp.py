"""The checkpoint's multi-token-prediction (MTP) head as a speculative drafter: ``speculative="mtp"``.

Qwen3.5/3.6-MoE and Qwen3-Next ship one MTP layer (``mtp.*``, docs/model.md §2.5, §9): from the main model's
hidden state at position p and the token at p + 1 it predicts the token at p + 2. `MtpDrafter` chains it
greedily, as vLLM (``EagleProposer.propose``) and mlx-vlm (``Qwen3_5MTPDraftModel.draft_block``) do:

* draft 1 (the token after the context) from the main model's hidden state at the last position the main
  model has consumed -- the one before the context's last token t, which is sampled but not yet fed --
  paired with t;
* draft j + 1 from the head's own output hidden state of step j, paired with draft j, one RoPE position on.

Where the weights come from: the checkpoint's own ``mtp.*`` tensors (`Weights.mtp`; mlx-lm conversions drop
them, ``qwenmetal convert --keep-mtp`` keeps them) or a separate MTP head folder (``model_type``
``"qwen3_5_mtp"``, as mlx-vlm's splitter writes it): ``MtpDrafter.for_model(model, path=folder)``.

A head of n layers (``mtp.layers.0..n-1``): draft step j of a round runs decoder layer j mod n, each layer with
its own KV cache; the context's pairs go through layer 0, a layer j >= 1 holds only the current chain's entries
(`ReferenceMtp` has the full statement, docs/speculative.md "Drafters" the reasons).

How it computes, on the cpu backend and in the Metal graph (resident experts): natively. The head runs over the
model's own embedding and lm_head with the checkpoint's quantized weights in place -- on cpu as one one-layer
C++ engine per decoder layer (`CpuBackend.mtp_head`), on metal / metal-sim as a GpuEngine of its own whose
round (the new pairs, then the k chained drafts, argmax on the GPU) is one command buffer
(`_GpuBackend.mtp_head`, docs/metal.md "The MTP head"). Its inputs are the final-normed hidden rows the
verification calls return (`Drafter.observe`): nothing of the main model runs twice. The head's KV cache holds
the (hidden, next token) pairs of the context: the prompt's (the prefill returns its hidden rows; a part
restored from the prefix cache has none) and the generated tokens'.

On any other backend (the reference; Metal in streaming mode): with the numpy reference
(`qwenmetal.backends.reference.ReferenceMtp`) on float32 (dequantized) weights. The head needs the main model's
hidden states, which those backends do not return, so the drafter runs its *own* reference session of the main
model over the context, incrementally (each round feeds only the tokens added since the last), and keeps the
MTP head's KV cache for the context's (hidden, next token) pairs. This is correct on every backend and fast on
none: it is the ground truth a backend's native MTP drafting is checked against. Drafting never changes the
output -- verification is exact (`qwenmetal.speculative`) -- only how many drafts are accepted.
"""
from __future__ import annotations

import os
import weakref
from typing import Sequence

import numpy as np

from .backends.reference import ReferenceModel, ReferenceMtp
from .memory import total_memory
from .session import ModelBase
from .speculative import Drafter
from .weights import load_mtp_head, to_float32

__all__ = ["MtpDrafter"]

#: id(Weights) -> (weakref to it, ReferenceModel on its float32 weights), shared by the drafters of one
#: loaded model (Weights is an unhashable dataclass; the entry goes when the weights do)
_REFERENCE_MODELS: dict = {}


def _reference_model(model: ModelBase):
    """A `ReferenceModel` of `model`: the reference backend's own, else one on the dequantized weights
    (built once per loaded model)."""
    impl = model.reference_model
    if isinstance(impl, ReferenceModel):
        return impl
    w = model.weights
    hit = _REFERENCE_MODELS.get(id(w))
    if hit is not None and hit[0]() is w:
        return hit[1]
    need, total = w.dense_float32_nbytes(), total_memory()
    if total and need > 0.75 * total:
        raise MemoryError(
            f"the MTP drafter computes with the numpy reference on float32 weights: {need / 2**30:.1f} GiB, more "
            f"than this machine can hold ({total / 2**30:.1f} GiB). It is meant for small checkpoints.")
    ref = ReferenceModel(model.config, w.dense_float32(), dtype="float32")
    key = id(w)
    _REFERENCE_MODELS[key] = (weakref.ref(w, lambda _r, key=key: _REFERENCE_MODELS.pop(key, None)), ref)
    return ref


#: model -> {id(params): (params, the native head)}: one native head per loaded model and head
_NATIVE_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _native_head(model: ModelBase, params: dict):
    """The backend's native MTP head over `params` (built once per model and head: `CpuMtpHead`, `GpuMtpHead`,
    with ``new_state()`` and ``draft(state, hidden, ids, k, vocab)``), None where the backend has none."""
    heads = _NATIVE_HEADS.setdefault(model, {})
    hit = heads.get(id(params))
    if hit is None or hit[0] is not params:
        head = model.mtp_head(params)
        if head is None:
            return None
        hit = heads[id(params)] = (params, head)
    return hit[1]


class MtpDrafter(Drafter):
    """Greedy drafts from the MTP head (see the module docstring). Build with `for_model`.

    ``hidden``: which hidden state of the main model feeds the head -- ``"final_norm"`` (default: the final
    norm's output, what vLLM and mlx-vlm feed) or ``"pre_norm"`` (the last decoder layer's output)."""

    name = "mtp"

    def __init__(self, model: ModelBase, params: dict, *, hidden: str = "final_norm", source=None):
        if hidden not in ("final_norm", "pre_norm"):
            raise ValueError(f"hidden must be 'final_norm' or 'pre_norm', got {hidden!r}")
        if not params:
            raise ValueError("MtpDrafter needs the MTP head's tensors")
        self.model = model
        self.params = params
        self.hidden = hidden
        self._source = source            # the mapped files of a separate head folder (kept open)
        self._ref = self._head = None
        self._native = None              # the backend's native head (`Model.mtp_head`), when native
        self._reset()

    @property
    def wants_hidden(self) -> bool:
        """Natively (cpu, Metal with resident experts): the head takes the verification calls' hidden rows."""
        return self._native is not None

    @classmethod
    def for_model(cls, model: ModelBase, path: str | os.PathLike | None = None, **options) -> "MtpDrafter":
        """The drafter of `model`'s own MTP head, or of the separate MTP head folder at `path`. Raises
        ValueError when the checkpoint has no (complete) MTP head and no `path` is given."""
        if path is not None:
            params, src = load_mtp_head(path, model.config)
            return cls(model, params, source=src, **options)
        w = model.weights
        params = getattr(w, "mtp", None) or {}
        if not params:
            why = getattr(w, "mtp_error", None)
            detail = f" ({why})" if why else ""
            raise ValueError(
                f"{model.path}: this checkpoint has no MTP head (mtp.* weights){detail}; convert with "
                f"--keep-mtp or pass a separate MTP head folder (--speculative mtp:DIR, or "
                f"MtpDrafter.for_model(model, path=DIR))")
        return cls(model, params, **options)

    # ---- state -----------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._main = None                  # the main model's reference state over `_held`
        self._held: list[int] = []         # tokens the main reference has consumed
        self._pending = None               # its hidden states [n, H] not yet paired in the MTP cache
        self._mtp = None                   # the MTP head's state: one KV entry per (h_p, t_{p+1}) pair

    def _build(self) -> None:
        if self._head is None:
            self._ref = _reference_model(self.model)
            self._head = ReferenceMtp.from_model(self._ref, {k: to_float32(v) for k, v in self.params.items()})

    def start(self, model: ModelBase) -> None:
        if model is not self.model:
            raise ValueError("this MtpDrafter was built for another model")
        head = _native_head(model, self.params) if self.hidden == "final_norm" else None
        if head is not None:
            self._native = head
            self._nstate = self._native.new_state()
            self._nh: dict = {}            # position -> the main model's hidden row there, not yet paired
            self._npos = 0                 # positions < this have their pair in the head's cache
        else:
            self._build()
        self._vocab = model.sampleable_vocab

    def observe(self, position: int, hidden: np.ndarray) -> None:
        for j in range(hidden.shape[0]):
            self._nh[position + j] = hidden[j]

    def _draft_native(self, ctx: list, k: int) -> list[int]:
        last = len(ctx) - 2                # the last fed position: its hidden pairs with ctx[-1]
        if last not in self._nh:
            return []
        ps = [p for p in sorted(self._nh) if self._npos <= p <= last]
        hid = np.ascontiguousarray(np.stack([self._nh[p] for p in ps]), dtype=np.float32)
        ids = np.asarray([ctx[p + 1] for p in ps], dtype=np.int64)
        # the context's pairs go into layer 0's cache for good; the chain's entries are dropped by the head
        drafts = self._native.draft(self._nstate, hid, ids, k, self._vocab)
        self._npos = last + 1
        for p in ps:
            del self._nh[p]
        return [int(d) for d in drafts]

    def _sync(self, ctx: list) -> None:
        """Bring the main reference to ``ctx[:-1]`` and the MTP cache to the pairs p < len(ctx) - 2."""
        upto = len(ctx) - 1
        held = self._held
        if self._main is None or len(held) > upto or held != ctx[:len(held)]:
            self._reset()                  # another context (a new generation): start over
            self._main, self._mtp = self._ref.new_state(), self._head.new_state()
            held = self._held
        if len(held) < upto:
            hid: list = []
            new = ctx[len(held):upto]
            which = "final_hidden" if self.hidden == "final_norm" else "hidden"
            self._ref.forward(self._main, np.asarray(new), logits="none", **{which: hid})
            h = hid[-1]                    # [len(new), H]
            held.extend(int(t) for t in new)
            self._pending = h if self._pending is None else np.concatenate([self._pending, h])

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        ctx = [int(t) for t in context]
        if k <= 0 or len(ctx) < 2:
            return []                      # no hidden state yet: the main model has consumed nothing
        if self._native is not None:
            return self._draft_native(ctx, k)
        self._build()
        self._sync(ctx)
        head, V = self._head, self._vocab
        n = head.n_layers
        # the context's own pairs (h_p, ctx[p+1]) for p = q .. len(ctx) - 2 go into the MTP cache for good
        q = self._mtp.position
        pend, self._pending = self._pending, None
        assert pend is not None and pend.shape[0] == len(ctx) - 1 - q, (q, None if pend is None else pend.shape)
        out: list = []
        logits = head.forward(self._mtp, pend, np.asarray(ctx[q + 1:]), logits="last", out_hidden=out)
        d = int(np.argmax(logits[:V]))
        drafts = [d]
        if k > 1:                          # chain on a copy: the drafts' entries are not the context's
            st, h = self._mtp.copy(), out[-1][-1:]
            for j in range(1, k):          # step j through layer j mod n
                out = []
                logits = head.forward(st, h, np.asarray([d]), logits="last", out_hidden=out, layer=j % n)
                d = int(np.argmax(logits[:V]))
                drafts.append(d)
                h = out[-1]
        return drafts

    def close(self) -> None:
        pass
