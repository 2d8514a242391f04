"""Exact speculative decoding: drafters, the verification of drafted tokens, and the adaptive draft length.

``model.generate(prompt, speculative="lookup")`` (or ``"mtp"``, a draft `Model`, or any `Drafter`) drafts up
to k tokens after each sampled one, runs the sampled token and the k drafts through the model in one
*verification* call (`verify`), and keeps the longest prefix the model agrees with:

* greedy: a draft is kept while it equals the model's own argmax, and the first disagreement is replaced
  by the model's token -- the output is the plain greedy output, token for token;
* sampling: a draft d is a point proposal, kept with probability p(d) under the sampler's distribution,
  else replaced by a draw from p without d (`Sampler.verify_draft`) -- the output distribution is p.

The rejected drafts leave the state with `rewind` (`verify` and `rewind` are the session layer's,
`qwenmetal.session`). On the cpu backend, and in the Metal graph (metal, metal-sim) with resident experts, a
verification call computes every row exactly as a one-token decode step does (docs/speculative.md), so the
logits, the tokens and the state after a rejection are bit for bit those of plain decoding.

`AdaptiveK` picks k from the measured acceptance rate and the measured cost of a round against a plain
decode step, and turns speculation off (k = 0) when it does not pay.
"""
from __future__ import annotations

import time
import weakref
from typing import Sequence

import numpy as np

from .interrupts import sigint_deferred
from .session import ModelBase, Session, rewind, rewindable, verify

#: the most drafts per round (k); rows verified at once = k + 1 (16: a DFlash block of the sampled token and
#: 15 drafts, and the Metal graph's verification limit)
MAX_DRAFT = 15


# ---- drafters -----------------------------------------------------------------------------------
class Drafter:
    """Proposes tokens that may follow a context. ``draft(context, k)`` returns up to `k` ids (fewer, or
    none, when it has no guess); it must be deterministic in its inputs (the acceptance rule treats a
    draft as a point proposal). ``start(model)`` is called once per generation; ``close()`` after it.
    A drafter whose `wants_hidden` is true also gets ``observe(position, hidden)`` after every round: the
    model's final-normed hidden rows [n, hidden] of the tokens kept at positions ``position..`` (the MTP
    head's input). A drafter with `feature_layers` (decoder-layer indices) gets
    ``observe_features(position, features)`` instead: the outputs of those layers for every token the model
    consumed in this generation, concatenated ([n, len(feature_layers) * hidden]; a DFlash draft's context).

    A drafter that samples its drafts overrides ``propose(context, k, temperature)``, returning the drafts
    and, per draft, the probability vector it was drawn from: the verification then uses the rejection rule
    for a drafted distribution q (accept with min(1, p/q), else draw from max(p - q, 0)) instead of the point
    rule."""

    name = "drafter"
    wants_hidden = False
    feature_layers: tuple = ()

    def observe(self, position: int, hidden: np.ndarray) -> None:
        pass

    def observe_features(self, position: int, features: np.ndarray) -> None:
        pass

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0) -> tuple[list, list | None]:
        """(drafts, their proposal distributions or None for point proposals); `draft` by default."""
        return self.draft(context, k), None

    def start(self, model: ModelBase) -> None:
        pass

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PromptLookup(Drafter):
    """Prompt lookup decoding: the tokens that followed the most recent earlier occurrence of the context's
    last n-gram (n from `max_ngram` down to `min_ngram`) in the session's own tokens. No weights; strong
    where the output repeats its input (code edits, retrieval, tool outputs)."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        ctx = np.asarray(context, dtype=np.int64)
        n_ctx = ctx.size
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ctx[n_ctx - n:]
            # windows starting at i < n_ctx - n that equal the tail, most recent first
            win = np.lib.stride_tricks.sliding_window_view(ctx[:n_ctx - 1], n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ctx[start:start + k].tolist()
        return []


class DraftModel(Drafter):
    """A smaller model of the same vocabulary drafts greedily with its own session. On the cpu backend it
    drafts through `verify` chains, so dropping its rejected drafts costs no recomputation."""

    name = "model"

    def __init__(self, model: ModelBase):
        self.model = model
        self.s: Session | None = None
        self.base = 0                  # the draft session's position where its open chain starts

    def start(self, model: ModelBase) -> None:
        if self.model.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model.config.vocab_size}) differs from the "
                             f"model's ({model.config.vocab_size})")
        self.s = self.model.new_session()
        self.base = 0
        self.vocab = self.model.sampleable_vocab

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        m, s = self.model, self.s
        ctx = list(context)
        held = s.tokens
        cp = 0
        lim = min(len(held), len(ctx) - 1)        # the last context token is always run (its logits draft)
        while cp < lim and held[cp] == ctx[cp]:
            cp += 1
        if rewindable(m, s):                      # drop the last round's drafts the model did not keep
            rewind(m, s, max(cp - self.base, 0))
        if s.position > cp:                       # diverged before the chain (another generation)
            s.reset()
        if s.position < len(ctx) - 1:             # the new context, but its last token, in one prefill
            m.prefill(s, ctx[s.position:len(ctx) - 1], "none")
        self.base = s.position
        out: list[int] = []
        logits = verify(m, s, ctx[-1:])[-1]
        for _ in range(k):
            t = int(np.argmax(logits[:self.vocab]))
            out.append(t)
            if len(out) == k or s.position + 1 > s.max_context:
                break
            logits = verify(m, s, [t])[-1]
        return out

    def close(self) -> None:
        if self.s is not None and rewindable(self.model, self.s):
            rewind(self.model, self.s, 0)


class ScriptedDrafter(Drafter):
    """Proposes ``script[p]`` for the token at position p (the context's length), for tests and benchmarks:
    the script is the target's own greedy continuation (an oracle), with the proposals at positions in
    `wrong_at` replaced by another id, or each one corrupted with probability `corrupt` (seeded)."""

    name = "scripted"

    def __init__(self, script: Sequence[int], wrong_at: Sequence[int] = (), corrupt: float = 0.0,
                 vocab: int | None = None, seed: int = 0):
        self.script = [int(t) for t in script]
        self.vocab = vocab or (max(self.script) + 2 if self.script else 2)
        rng = np.random.default_rng(seed)
        bad = set(int(p) for p in wrong_at)
        bad |= {p for p in range(len(self.script)) if corrupt and rng.random() < corrupt}
        self.bad = bad

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        p0 = len(context)
        out = []
        for p in range(p0, min(p0 + k, len(self.script))):
            t = self.script[p]
            out.append((t + 1) % self.vocab if p in self.bad else t)
        return out


# ---- the draft length -------------------------------------------------------------------------------
def check_k(k) -> None:
    """`speculative_k`: None (adaptive) or 0..MAX_DRAFT; else ValueError."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= MAX_DRAFT):
        raise ValueError(f"speculative_k must be in 0..{MAX_DRAFT}, got {k!r}")


class AdaptiveK:
    """Chooses the drafts per round. With a measured acceptance rate a_i at each draft position i (the
    share of rounds that reached draft i and kept it: a block drafter's later drafts are kept less often
    than its first), a round of k drafts yields E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens in the
    time T(k) of drafting and verifying k + 1 rows; plain decoding yields 1 token in T(0). The choice
    maximises E(k) / T(k) over k = 0 .. k_max, so k = 0 (plain decoding) wins whenever speculation does not
    pay; while plain decoding is chosen a round of k = 1 is tried every `probe_every` steps so a change in
    acceptance is noticed. `fixed`: always k.

    * a_i: decayed counts of the rounds that reached position i and kept it, with a prior of one round at
      the overall rate (0.7 before anything is measured); a position not reached yet takes the rate of the
      one before it. A few rounds settle it.
    * T(k): an exponential average of the measured rounds of k drafts. An unmeasured k between two measured
      ones takes the cost of the shorter (a lower bound: verifying more rows never costs less), so a length
      that might pay is tried once rather than ruled out by a straight line through costs that are not
      straight (a verification's rows read the union of their experts); past the longest measured k the
      last two measured points are extended. `cost` may be a table shared with earlier generations of the
      same model and drafter (`Speculation` keeps one per pair), so a new generation starts from their
      measurements."""

    def __init__(self, k_max: int = MAX_DRAFT, fixed: int | None = None, probe_every: int = 16,
                 decay: float = 0.25, cost: dict | None = None):
        check_k(fixed)
        self.k_max = int(fixed if fixed is not None else k_max)
        self.fixed = fixed
        self.probe_every = probe_every
        self.decay = decay
        self.cost: dict[int, float] = {} if cost is None else cost   # k -> seconds per round (0: a decode step)
        self.acc = 0.7                       # prior: accepted / drafted
        self.kept: dict[int, float] = {}     # draft position i (1-based) -> decayed count of rounds that kept it
        self.reached: dict[int, float] = {}  # ... that reached it
        self.drafted = self.accepted = 0
        self.spec_rounds = 0                 # rounds with drafts
        self.since_probe = self.rounds = 0
        self.last = 0                        # the k chosen last

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.decay) * old + self.decay * new

    def observe(self, k: int, seconds: float, drafted: int = 0, accepted: int = 0) -> None:
        self.cost[k] = self._avg(self.cost.get(k), seconds)
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.spec_rounds += 1
            self.acc = self._avg(self.acc, accepted / drafted)
            # positions 1..accepted were kept; position accepted + 1 (if drafted) was reached and rejected
            keep = 1 - self.decay / 2
            for i in range(1, min(accepted + 1, drafted) + 1):
                self.reached[i] = keep * self.reached.get(i, 0.0) + 1.0
                self.kept[i] = keep * self.kept.get(i, 0.0) + (1.0 if i <= accepted else 0.0)

    def rates(self) -> list:
        """a_1 .. a_k_max: the measured acceptance at each draft position (unreached: the one before's)."""
        out, prev = [], self.acc
        for i in range(1, self.k_max + 1):
            if i in self.reached:
                prev = (self.kept[i] + prev) / (self.reached[i] + 1.0)
            out.append(min(max(prev, 0.0), 0.999))
        return out

    def expected_tokens(self, k: int) -> float:
        """E(k): the tokens a round of k drafts yields under the measured per-position rates."""
        e, run = 1.0, 1.0
        for a in self.rates()[:k]:
            run *= a
            e += run
        return e

    def _t(self, k: int) -> float:
        if k in self.cost:
            return self.cost[k]
        pts = sorted(self.cost.items())
        if not pts:
            return 1.0 + 0.3 * k
        below = [p for p in pts if p[0] < k]
        if below and len(below) < len(pts):
            return below[-1][1]               # between two measured lengths: the shorter one's cost
        if len(below) >= 2:
            (k0, t0), (k1, t1) = below[-2:]
            return t1 + max((t1 - t0) / (k1 - k0), 0.0) * (k - k1)
        k0, t0 = pts[0] if not below else below[-1]
        return max(t0 * (1 + 0.3 * k) / (1 + 0.3 * k0), 1e-9)

    def choose(self) -> int:
        self.last = self._choose()
        return self.last

    def _choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        self.rounds += 1
        if 0 not in self.cost or self.rounds % (2 * self.probe_every) == 0:
            return 0                          # (re)measure a plain decode step
        best, gain = 0, 1.0 / self._t(0)
        for k in range(1, self.k_max + 1):
            g = self.expected_tokens(k) / self._t(k)
            if g > gain * 1.001:              # a tie (nothing to gain) stays shorter
                best, gain = k, g
        if best == 0:
            self.since_probe += 1
            if self.since_probe >= self.probe_every:
                self.since_probe = 0
                return 1                      # a round now and then keeps the acceptance rate current
        return best

    def stats(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,   # None: nothing drafted
                # tokens per round with drafts: its kept drafts and the model's own token after them
                "mean_accepted_length": (1 + self.accepted / self.spec_rounds) if self.spec_rounds else None,
                "draft_length": self.last}


#: model -> {drafter name: AdaptiveK's cost table}: the measured cost of a round of k drafts, kept from one
#: generation to the next (a server or a chat generates many times with one model and drafter)
_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Speculation:
    """One generation's speculative decoding (`qwenmetal.generation` runs it): the drafter, the draft length
    and the session's open verify chain. ``step(t, context)`` feeds the sampled token t with the drafts
    after it and returns (logits of every row [1 + k, vocab], drafts); the loop then decides the tokens,
    calls ``fed()`` for each drafted token it emits and continues after (it stays in the state), and
    ``end_round(accepted)`` before feeding the next token; ``close()`` ends an open chain keeping what was
    fed, so the session holds what plain decoding would have fed, however the generation ends."""

    def __init__(self, model: ModelBase, s: Session, drafter: Drafter, k: int | None, temperature: float = 0.0):
        self.model, self.s, self.drafter = model, s, drafter
        self.k = AdaptiveK(fixed=k, cost=_COSTS.setdefault(model, {}).setdefault(drafter.name, {}))
        self.temperature = float(temperature)
        self.rounds = 0
        self.open = False
        self.n_fed = 0
        self._round = (0, 0.0)
        self.layers = tuple(drafter.feature_layers)
        if self.layers and not model.returns_features:
            raise ValueError(f"the {drafter.name} drafter reads the outputs of the model's layers "
                             f"{list(self.layers)}, which the {model.backend} backend does not return")
        if self.layers:
            model.check_feature_layers(self.layers)
        drafter.start(model)

    def prefill(self, ids, logits: str):
        """`Model.prefill` of the session; a drafter that wants hidden states gets every row's, on a backend
        that returns them (cpu), and one that wants layer features gets every row's."""
        m, s = self.model, self.s
        pos = s.position
        if self.layers:
            out, feats = m.prefill_features(s, ids, logits, self.layers)
            self.drafter.observe_features(pos, feats)
            return out
        if not (self.drafter.wants_hidden and m.returns_hidden):
            return m.prefill(s, ids, logits)
        out, hidden = m.prefill_hidden(s, ids, logits)
        self.drafter.observe(pos, hidden)
        return out

    def position(self) -> int:
        """The session's position as plain decoding would have it (the fed tokens of an open round)."""
        extra = rewindable(self.model, self.s) - self.n_fed if self.open else 0
        return self.s.position - extra

    def step(self, t: int, context: list, budget: int) -> tuple[np.ndarray, list, list | None]:
        """Feed t (the last token of `context`) and up to `budget` drafts after it. Returns (logits of every
        row, drafts, the drafts' proposal distributions or None: `Drafter.propose`)."""
        m, s = self.model, self.s
        t0 = time.perf_counter()
        k = min(self.k.choose(), s.max_context - s.position - 1, budget)
        if m.max_verify_rows is not None:      # the sampled token and the drafts in one verification call
            k = min(k, m.max_verify_rows - 1)
        drafts, probs = self.drafter.propose(context, k, self.temperature) if k > 0 else ([], None)
        drafts = [int(d) for d in drafts[:k]]
        if any(not 0 <= d < m.config.vocab_size for d in drafts):
            raise ValueError(f"drafter {self.drafter.name!r} proposed an id outside the vocabulary: {drafts}")
        if probs is not None:
            probs = list(probs[:len(drafts)])
            if len(probs) != len(drafts):
                raise ValueError(f"drafter {self.drafter.name!r} gave {len(probs)} distributions for "
                                 f"{len(drafts)} drafts")
        hidden, layers = self.drafter.wants_hidden, self.layers
        if not drafts and not hidden and not layers:
            logits = m.prefill(s, [t], "last")[None]
            self.k.observe(0, time.perf_counter() - t0)
            return logits, [], None
        self._pos0 = s.position
        with sigint_deferred():           # the round is open exactly when the session holds its rows
            if layers:                    # a one-row verification is a decode step, with its features
                logits, self._hidden = verify(m, s, [t, *drafts], features=layers)
            elif hidden:                  # ... or with its hidden row
                logits, self._hidden = verify(m, s, [t, *drafts], return_hidden=True)
            else:
                logits = verify(m, s, [t, *drafts])
            self.open, self.n_fed = True, 1
        self._round = (len(drafts), time.perf_counter() - t0)
        self.rounds += bool(drafts)
        return logits, drafts, probs

    def fed(self) -> None:
        self.n_fed += 1

    def end_round(self, accepted: int) -> None:
        if self.open:
            with sigint_deferred():       # a Ctrl-C lands before or after the rewind, never between
                rewind(self.model, self.s, self.n_fed)
                self.open = False
            k, dt = self._round
            self.k.observe(k, dt, k, accepted)
            if self.layers:
                self.drafter.observe_features(self._pos0, self._hidden[:self.n_fed])
            elif self.drafter.wants_hidden:
                self.drafter.observe(self._pos0, self._hidden[:self.n_fed])

    def close(self) -> None:
        try:
            with sigint_deferred():       # the session ends holding what plain decoding fed, Ctrl-C or not
                if self.open:
                    rewind(self.model, self.s, self.n_fed)
                    self.open = False
        finally:
            self.drafter.close()

    def stats(self) -> dict:
        return {"drafter": self.drafter.name, "rounds": self.rounds, **self.k.stats()}
