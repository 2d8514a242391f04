"""qwenmetal: Qwen3.5/3.6-MoE and Qwen3-Next (hybrid Gated DeltaNet + attention MoE) inference.

    import qwenmetal as qm
    model = qm.Model.load("path/or/org-name", backend="reference")
    s = model.new_session()
    logits = model.prefill(s, ids)
"""
from .chat import ChatResponse
from .config import ModelConfig, QuantizationConfig
from .errors import CheckpointError, ImageError, InputError
from .generation import GenerationOutput
from .grammar import Grammar, GrammarError
from .model import Model
from .options import GenerationOptions
from .prefix_cache import PrefixCache
from .sampling import Sampler
from .session import Session, SessionSnapshot
from .version import __version__

__all__ = ["Model", "Session", "SessionSnapshot", "GenerationOutput", "ModelConfig", "QuantizationConfig",
           "CheckpointError", "InputError", "ImageError", "Sampler", "GenerationOptions", "PrefixCache",
           "ChatResponse", "Grammar", "GrammarError", "__version__"]
