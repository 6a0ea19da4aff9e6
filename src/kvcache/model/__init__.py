"""The Llama-family decoder (llama, mistral, qwen2), its config and strict checkpoint loading."""

from kvcache.model.config import ConfigError, ModelConfig, RopeScaling
from kvcache.model.llama import CacheInTrainingError, CausalLMOutput, LlamaForCausalLM
from kvcache.model.load import CheckpointError, load_model

__all__ = [
    "CacheInTrainingError",
    "CausalLMOutput",
    "CheckpointError",
    "ConfigError",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeScaling",
    "load_model",
]
