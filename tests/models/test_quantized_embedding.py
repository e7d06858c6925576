"""A GGUF model's quantized token embedding is looked up from its blocks: the same bits as the
float32 table it used to expand at load, in the module path and in the decode stack's own lookups,
at a fraction of the memory."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models import load_model, weights
from chatloom.models.kernels import load_kernels
from chatloom.models.memory_check import gguf_weight_bytes
from chatloom.models import gguf_loader
from chatloom.models.gguf_loader import open_gguf
from chatloom.models.quantized_embedding import QuantizedEmbedding

import tiny_checkpoints as tc

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable")


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0", "Q4_K"])
def test_lookups_equal_the_dequantized_table(kind):
    raw = tc.random_kquant_blocks(kind, 50, 512, seed=4)
    table = tc.dequantize(kind, raw)
    emb = QuantizedEmbedding(raw, kind, 512)
    ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
    assert torch.equal(emb(ids), F.embedding(ids, table))
    assert emb.weight.dtype == torch.float32 and emb.blocks.nbytes == raw.nbytes
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))


def _mapping_of(address: int) -> str:
    """The file (or "") of this process's mapping that holds `address`, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_a_table_in_a_mapped_file_is_mapped_not_copied(tmp_path):
    raw = tc.random_kquant_blocks("Q6_K", 50, 512, seed=4)
    path = tmp_path / "table.bin"
    path.write_bytes(b"x" * 100 + raw.tobytes())  # the table at an offset, as a GGUF file holds it
    mm = np.memmap(path, mode="r")
    view = np.frombuffer(mm, dtype=np.uint8, count=raw.nbytes, offset=100).reshape(raw.shape)
    emb = QuantizedEmbedding(view, "Q6_K", 512)
    assert _mapping_of(emb.blocks.data_ptr()) == str(path)  # the file's pages: no new memory
    del mm, view  # its own mapping: the loader's may go
    ids = torch.tensor([0, 17, 49])
    assert torch.equal(emb(ids), F.embedding(ids, tc.dequantize("Q6_K", raw)))


def _q4_k_m_file(tmp_path, monkeypatch):
    """A tied Q4_K_M-style file whose embedding (and so head) is Q6_K, as llama.cpp writes them."""
    cfg = tc.hf_config("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    monkeypatch.setitem(tc.KQUANT_MIX, "token_embd", "Q6_K")
    path = tmp_path / "kq.gguf"
    tc.write_kquant_gguf(path, cfg, seed=3)
    monkeypatch.delitem(tc.KQUANT_MIX, "token_embd")
    return path


def _greedy(loaded) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4))
    prompts = [list(range(3, 40)), [5, 9, 11], list(range(100, 120))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def test_a_q4_k_m_model_keeps_its_embedding_in_blocks_with_the_same_output(tmp_path, monkeypatch):
    path = _q4_k_m_file(tmp_path, monkeypatch)
    asked: list[str] = []
    real_get = gguf_loader.GGUFWeights.get
    with monkeypatch.context() as m:
        m.setattr(gguf_loader.GGUFWeights, "get", lambda self, name: asked.append(name) or real_get(self, name))
        kept = load_model(str(path), "fp32")
    assert asked and "model.embed_tokens.weight" not in asked  # no float32 table was made
    assert isinstance(kept.model.embed_tokens, QuantizedEmbedding) and kept.model.embed_tokens.kind == "Q6_K"
    with monkeypatch.context() as m:
        m.setattr(weights, "_kept_embedding", lambda *a: None)  # the float32 table, as before
        table = load_model(str(path), "fp32")
    assert isinstance(table.model.embed_tokens, torch.nn.Embedding)
    seqs = [list(range(3, 43)), [7, 8, 9]]
    assert all(torch.equal(a, b) for a, b in zip(kept.model.dense_logits(seqs), table.model.dense_logits(seqs)))
    stack = kept.model.decode_stack()
    if stack is not None and stack.has_head:  # decode steps embed their ids in C++, from the blocks
        assert stack.has_embedding and kept.model.decodes_tokens()
    assert _greedy(kept) == _greedy(table)


def test_the_memory_check_counts_the_embeddings_blocks(tmp_path, monkeypatch):
    tensors = open_gguf(_q4_k_m_file(tmp_path, monkeypatch)).tensors
    embd = next(t for t in tensors if t.name == "token_embd.weight")
    as_blocks = gguf_weight_bytes(tensors, 4, True, True)
    as_floats = gguf_weight_bytes(tensors, 4, True, True, float_embedding=True)
    rows, row_bytes = embd.data.shape
    assert as_floats - as_blocks == rows * (row_bytes // 210 * 256) * 4 - embd.data.nbytes
