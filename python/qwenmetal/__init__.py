"""qwenmetal: Qwen3.5/3.6-MoE and Qwen3-Next (hybrid Gated DeltaNet + attention MoE) inference.

    import qwenmetal as qm
    model = qm.Model.load("path/or/org-name", backend="reference")
    s = model.new_session()
    logits = model.prefill(s, ids)
"""
from .config import ModelConfig, QuantizationConfig
from .chat import ChatResponse
from .errors import CheckpointError, InputError
from .model import GenerationOutput, Model, Session, SessionSnapshot
from .options import GenerationOptions
from .prefix_cache import PrefixCache
from .sampling import Sampler

__version__ = "0.1.0"

__all__ = ["Model", "Session", "SessionSnapshot", "GenerationOutput", "ModelConfig", "QuantizationConfig",
           "CheckpointError", "InputError", "Sampler", "GenerationOptions", "PrefixCache", "ChatResponse",
           "__version__"]
