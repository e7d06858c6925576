"""Tokenizers built with the `tokenizers` library, from GGUF metadata or tokenizer.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from chatloom.models.config import ModelError

# The split pattern llama-3 style BPE tokenizers apply before byte-level encoding
# (numbers in groups of up to three digits); qwen2 splits numbers into single digits.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre values whose split is GPT-2's own (ByteLevel's built-in regex).
_GPT2_PRE = ("gpt2", "gpt-2", "default")
_CONTROL, _USER_DEFINED = 3, 4


# From this length a text is encoded without holding the GIL (encode_batch); shorter ones keep the
# cheaper single call, whose GIL hold is short.
_GIL_FREE_CHARS = 16_384


@dataclass
class TextTokenizer:
    """What the engine and the product need of a tokenizer."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    chat_template: str | None
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False
    special_ids: set[int] = field(default_factory=set)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        if len(text) >= _GIL_FREE_CHARS:
            # tokenizers' encode holds the GIL throughout (a 900 KB message: 0.37 s in which no other
            # Python thread, the event loop included, ran); encode_batch lets it go. Same ids.
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def from_gguf(reader: Any) -> TextTokenizer:
    from chatloom.models.gguf_loader import field as gf

    kind = gf(reader, "tokenizer.ggml.model")
    tokens: list[str] = gf(reader, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelError("GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    types = gf(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in gf(reader, "tokenizer.ggml.merges") or []]
        pre = gf(reader, "tokenizer.ggml.pre") or "gpt2"
        # Llama 3's tokenizer takes a whole word that is in the vocabulary without merging.
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre == "llama-bpe"))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in _GPT2_PRE + ("smollm",))
        if pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in _GPT2_PRE:
            tok.pre_tokenizer = byte_level
        else:
            split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = gf(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = gf(reader, "tokenizer.ggml.unknown_token_id", 0)
        tok = Tokenizer(models.Unigram(list(zip(tokens, map(float, scores))), unk_id=int(unk), byte_fallback=True))
        # SentencePiece marks a word start with "▁" and (Llama, Mistral) adds one before the
        # text; Gemma's files say add_space_prefix = false.
        prefix = bool(gf(reader, "tokenizer.ggml.add_space_prefix", True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
                                              if prefix else [normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    else:
        raise ModelError(f"unsupported tokenizer model {kind!r} in GGUF file")
    special = [i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special
                            if types[i] == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i in special if types[i] == _USER_DEFINED])
    del vocab

    bos = gf(reader, "tokenizer.ggml.bos_token_id")
    eos = gf(reader, "tokenizer.ggml.eos_token_id")
    eot = gf(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = sorted({int(x) for x in (eos, eot) if x is not None})
    return TextTokenizer(
        tokenizer=tok,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        chat_template=gf(reader, "tokenizer.chat_template"),
        bos_token=tokens[int(bos)] if bos is not None else "",
        eos_token=tokens[int(eos)] if eos is not None else "",
        add_bos=bool(gf(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
        special_ids={i for i, t in enumerate(types) if t == _CONTROL},
    )


def _token_str(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


def from_hf_folder(folder: Path, generation_eos: list[int] | None = None) -> TextTokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelError(f"{folder} has no tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelError(f"cannot read {path}: {exc}") from None
    cfg: dict = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template is None and (folder / "chat_template.json").exists():  # a processor's (vision models)
        try:
            template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            raise ModelError(f"cannot read {folder / 'chat_template.json'}") from None
    bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    eos_ids = set(generation_eos or [])
    if eos and tok.token_to_id(eos) is not None:
        eos_ids.add(tok.token_to_id(eos))
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    # tokenizer.json post-processors add BOS themselves; we add it by hand to control it.
    return TextTokenizer(tok, bos_id, sorted(eos_ids), template, bos, eos,
                         add_bos=bool(cfg.get("add_bos_token", False)), special_ids=special)
