"""The command-line arguments that several commands share (`qwenmetal.cli` and `qwenmetal bench`)."""
from __future__ import annotations

import argparse

from .expert_streaming import POLICIES


def add_expert_args(g) -> None:
    """--expert-slots, --expert-policy, --expert-direct-io (`expert_options` reads them); `qwenmetal bench`
    adds them beside its own --memory-budget."""
    g.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="expert cache slots per MoE layer (forces streaming; default: as many as the budget holds)")
    g.add_argument("--expert-policy", default=None, choices=POLICIES,
                   help="expert cache replacement policy (default: the planner's, lfu)")
    g.add_argument("--expert-direct-io", action="store_true",
                   help="read streamed experts past the page cache (O_DIRECT / F_NOCACHE): their bytes are held "
                        "once, in the cache's slots")


def expert_options(args) -> dict:
    """The backend options the expert flags set; flags left at their defaults are left out."""
    o = {}
    if args.expert_slots is not None:
        o["expert_slots"] = args.expert_slots
    if args.expert_policy is not None:
        o["expert_policy"] = args.expert_policy
    if args.expert_direct_io:
        o["expert_direct_io"] = True
    return o


def seed_arg(text: str) -> int:
    """argparse type of --seed: an integer >= 0 (argparse's message then names the option)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (the same seed gives the same result), "
                                         f"got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (the same seed gives the same result), got {v}")
    return v
