"""Hugging Face MoE checkpoints (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5, GPT-OSS):
config, load, save.

    cfg = fmoe.hf.config(hf_dir)            # a ModelConfig
    params = fmoe.hf.load(hf_dir, plan)     # this rank's part under plan
    fmoe.hf.save(out_dir, params, plan)     # collective; config.json + safetensors
    fmoe.hf.save_adapter(out_dir, adapters, plan)  # PEFT's LoRA adapter folder
    python -m fmoe.hf export runs/x/checkpoint --out hf/x   # + tokenizer, generation config
"""

from .adapter import save_adapter
from .api import config, load, save
from .families import FAMILIES, family_of

__all__ = ["FAMILIES", "config", "family_of", "load", "save", "save_adapter"]
