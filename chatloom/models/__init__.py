"""Model definitions, weight loading, tokenizers and chat templates."""
from chatloom.models.config import ModelConfig, ModelError

__all__ = ["ModelConfig", "ModelError", "LoadedModel", "describe_config", "load_model", "load_tokenizer"]


def __getattr__(name: str):
    # The loader imports torch (seconds); load it on first use so that light users
    # (the registry, configs, `chatloom --help`) start fast.
    if name in ("LoadedModel", "describe_config", "load_model", "load_tokenizer"):
        from chatloom.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'chatloom.models' has no attribute {name!r}")
