"""Model definitions, weight loading, tokenizers and chat templates."""
from chatloom.models.config import ModelConfig, ModelError
from chatloom.models.loader import LoadedModel, describe_config, load_model

__all__ = ["ModelConfig", "ModelError", "LoadedModel", "describe_config", "load_model"]
