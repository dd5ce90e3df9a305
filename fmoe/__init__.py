"""fmoe: Mixture-of-Experts transformers as pure functions over parameter pytrees."""

import warnings

# torch warns at import when NumPy is absent; fmoe never uses NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from . import layers  # noqa: E402
from .checkpoint import Checkpoint, load, save  # noqa: E402
from .config import ModelConfig, Plan  # noqa: E402
from .optim import (  # noqa: E402
    Optimizer,
    Transform,
    adamw,
    chain,
    clip_by_global_norm,
    global_norm,
    optimizer,
    scale_by_adam,
    update_expert_bias,
    warmup_cosine,
)
from .params import glu_from_interleaved, glu_to_interleaved, init, param_shapes  # noqa: E402
from .shard.gather import gather_full  # noqa: E402
from .shard.trace import export_chrome_trace  # noqa: E402
from .step import StepOutput, eval_loss, step  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "ModelConfig", "Optimizer", "Plan", "StepOutput", "Transform", "adamw", "chain",
    "clip_by_global_norm", "eval_loss", "export_chrome_trace", "gather_full", "global_norm", "glu_from_interleaved", "glu_to_interleaved", "init",
    "layers", "load", "optimizer", "param_shapes", "save", "scale_by_adam", "step",
    "update_expert_bias", "warmup_cosine",
]
