"""The weight-memory table: files planned the way llama.cpp writes them, sized the way the
loader holds them."""
from __future__ import annotations

import pytest

from chatloom.models.gguf_loader import open_gguf
from chatloom.models.hf_config import config_from_hf, read_config_file
from chatloom.models.memory_check import _numel
from chatloom.models.weight_memory import FILE_TYPES, planned_tensors, weight_bytes

import tiny_checkpoints as tc
import tiny_gguf as tg


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
                                  "qwen2_moe", "qwen3_moe"])
def test_planned_layout_is_the_files(arch, tmp_path):
    """Every family's planned tensors are the ones a converted file holds, element for element."""
    cfg = tg.kquant_config(arch)
    tg.kquant_gguf(tmp_path / "m.gguf", cfg)
    in_file = {t.name: _numel(t) for t in open_gguf(tmp_path / "m.gguf").tensors}
    planned = {t.name: _numel(t) for t in planned_tensors(config_from_hf(cfg), "Q4_K_M")}
    biases = {n for n in in_file if n.endswith(".bias")}  # not counted: a few floats
    assert planned == {n: v for n, v in in_file.items() if n not in biases}


def test_q4_k_m_recipe():
    from pathlib import Path

    import chatloom

    cfg = read_config_file(Path(chatloom.__file__).parent / "examples" / "mistral-7b.json")
    kinds = {t.name: t.tensor_type.name for t in planned_tensors(cfg, "Q4_K_M")}
    assert kinds["output.weight"] == "Q6_K" and kinds["token_embd.weight"] == "Q4_K"
    assert sum(kinds[f"blk.{i}.attn_v.weight"] == "Q6_K" for i in range(32)) == 16
    assert [kinds[f"blk.{i}.ffn_down.weight"] for i in (0, 3, 4, 6, 28)] == ["Q6_K", "Q6_K", "Q4_K", "Q6_K", "Q6_K"]
    assert kinds["blk.5.attn_q.weight"] == "Q4_K" and kinds["blk.5.attn_norm.weight"] == "F32"
    sizes = [weight_bytes(cfg, k) for k in FILE_TYPES]
    assert sizes[0] == sizes[1] == sizes[2] == 4 * cfg.num_parameters()  # float files load as float32
    assert round(weight_bytes(cfg, "Q4_K_M") / 2**30, 1) == 6.1  # the embedding in its Q4_K blocks
    assert weight_bytes(cfg, "BF16", float_bytes=2, keeps_quantized=False) == 2 * cfg.num_parameters()
    with pytest.raises(ValueError, match="unknown file type"):
        planned_tensors(cfg, "Q3_K_S")
