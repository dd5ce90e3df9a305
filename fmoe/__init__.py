"""fmoe: Mixture-of-Experts transformers as pure functions over parameter pytrees."""

from . import layers
from .batch import local_batch
from .checkpoint import Checkpoint, load, save
from .config import ModelConfig, Plan
from .lora_spec import LoRA
from .optim import (
    Optimizer,
    Transform,
    adamw,
    apply_if_finite,
    chain,
    clip_by_global_norm,
    global_norm,
    last_grad_norm,
    optimizer,
    scale_by_adam,
    skipped_steps,
    update_expert_bias,
    warmup_cosine,
)
from .initialize import init
from .params import active_param_count, glu_from_interleaved, glu_to_interleaved, param_shapes, train_flops_per_token
from .gather import gather_full
from .comm.trace import export_chrome_trace
from .step import StepOutput, eval_loss, step

from . import hf, lora  # noqa: E402  (build on everything above)

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "LoRA", "ModelConfig", "Optimizer", "Plan", "StepOutput", "Transform", "active_param_count", "adamw",
    "apply_if_finite", "chain", "clip_by_global_norm", "eval_loss", "export_chrome_trace", "gather_full",
    "global_norm", "glu_from_interleaved", "glu_to_interleaved", "hf", "init", "last_grad_norm", "layers", "load",
    "local_batch", "lora",
    "optimizer",
    "param_shapes", "save", "scale_by_adam", "skipped_steps", "step", "train_flops_per_token",
    "update_expert_bias", "warmup_cosine",
]
