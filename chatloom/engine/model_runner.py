"""Owns the KV pool and turns one scheduled batch into one forward pass."""
from __future__ import annotations

import bisect
import math
import mmap
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from chatloom.engine.sampler import GreedyPicks
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sequence import Sequence
from chatloom.models.attention import AttentionBatch, PrefillSegment, chunk_mask
from chatloom.models.kernels import load_kernels
from chatloom.models.llama import LlamaForCausalLM
from chatloom.models.memory_check import check_fits
from chatloom.models.vision.idefics3 import Idefics3Vision
from chatloom.models.vision.prompt import ImageInput
from chatloom.engine.encoder_cache import EncoderCache
from chatloom.engine.encoder_plan import PlannedPiece


def allocate_kv_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int,
                      dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pool pair per layer, of `dtype` (default: the model's)."""
    cfg = model.config
    dtype = dtype or model.embed_tokens.weight.dtype
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    # Refuse with the sizes rather than be killed while zeroing the pool.
    per_layer = num_blocks * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    check_fits(f"a KV cache of {num_blocks} blocks", 0, 2 * cfg.num_layers * per_layer)
    return [(zeroed_on_demand(shape, dtype), zeroed_on_demand(shape, dtype)) for _ in range(cfg.num_layers)]


def zeroed_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the kernel supplies on first write (a private anonymous mapping): a
    pool sized for several full contexts costs resident memory only as conversations fill it, where
    torch.zeros would write every page at once. Page-aligned, as the kernels like it."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    with warnings.catch_warnings():  # the mapping is writable; torch warns about buffers in general
        warnings.simplefilter("ignore", UserWarning)
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [len(sampled), vocab]
    argmax: torch.Tensor | None
    sampled: list[Sequence]  # the sequences that produce a token this step, in logits order
    failed: dict[Sequence, Exception] = field(default_factory=dict)  # sequences whose forward failed alone
    picks: GreedyPicks | None = None  # each row's argmax as ints, where a native step found them (logits may be [T, 0])
    # Prefill chunks of requests asking their prompt's logprobs: (sequence, first position, logits of every query).
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
    interrupted: bool = False  # an interruptible step stopped part-way: nothing came of it


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 use_kernels: bool = True, kv_cache_dtype: torch.dtype | None = None,
                 vision: Idefics3Vision | None = None, encoder_cache: EncoderCache | None = None) -> None:
        self.model = model
        # A vision-language model's image side, and its outputs by image hash.
        self.vision = vision
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCache(0)
        # Encoder work done: pieces finished, images encoded from their first piece, their embeddings,
        # slices run (a piece's layers in one step), the embedding-layers run and the seconds they took
        # (the engine reads the last two per step to pace the encoder).
        self.encoder_pieces = 0
        self.encoder_runs = 0
        self.encoder_tokens = 0
        self.encoder_slices = 0
        self.encoder_work = 0
        self.encoder_seconds = 0.0
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(model, num_blocks, block_size, kv_cache_dtype)
        self._pools = ([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches])
        dtype = model.embed_tokens.weight.dtype
        self.kernels = load_kernels() if use_kernels and dtype in (torch.float32, torch.float64) else None
        # Called just before each forward's native code (which runs without the GIL): AsyncEngine
        # hands the previous step's outputs to the event loop there.
        self.before_forward: Callable[[], None] | None = None
        # Whether a decode step whose rows are all plain greedy may skip the logits, plain or checking
        # proposals (tests turn it off to compare).
        self.argmax_only_steps = True
        # Whether short prefill chunks beside decodes run as decode queries, where the model has a native
        # decode stack (tests turn it off to compare).
        self.mixed_as_decode = True

    def copy_block_prefix(self, src: int, dst: int, n: int) -> None:
        """Block dst's first n K/V slots from block src's, in every layer (a partial prefix-cache hit)."""
        for k, v in self.kv_caches:
            k[dst, :n] = k[src, :n]
            v[dst, :n] = v[src, :n]

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        kern = self.kernels
        attn = AttentionBatch(num_decode=len(batch.decodes), block_size=bs, kernels=kern)

        as_queries = self._chunks_as_decode_queries(batch)
        if batch.decodes:
            tables, ctx_lens = [], []
            rows: list[int] | None = None  # query -> table row, when some decode carries proposed tokens
            for seq in batch.decodes:
                pos = seq.num_computed_tokens
                table = seq.block_table
                ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                ctx_lens.append(pos + 1)
                if seq.spec_token_ids:
                    # Speculative decoding: the proposed tokens follow as extra queries of the
                    # same sequence, each seeing the keys up to and including itself.
                    if rows is None:
                        rows = list(range(len(tables)))
                    rows.append(len(tables))
                    for j, token in enumerate(seq.spec_token_ids, 1):
                        ids.append(token)
                        positions.append(pos + j)
                        slots.append(table[(pos + j) // bs] * bs + (pos + j) % bs)
                        ctx_lens.append(pos + j + 1)
                        rows.append(len(tables))
                elif rows is not None:
                    rows.append(len(tables))
                tables.append(table)
            logit_rows.extend(range(len(ids)))
            for seq, n in batch.prefills if as_queries else ():
                # A short chunk beside decodes: its tokens are queries of the decode path, each seeing
                # the keys up to and including itself, as proposed tokens are (the native stack then
                # runs the whole step); only a prompt's last token gives logits.
                if rows is None:
                    rows = list(range(len(tables)))
                start, table = seq.num_computed_tokens, seq.block_table
                for p in range(start, start + n):
                    ids.append(seq.token_ids[p])
                    positions.append(p)
                    slots.append(table[p // bs] * bs + p % bs)
                    ctx_lens.append(p + 1)
                    rows.append(len(tables))
                if start + n == len(seq):
                    logit_rows.append(len(ids) - 1)
                tables.append(table)
            attn.num_decode = len(ids)
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            # Key counts for the kernel, and for windowed layers' masks on either path.
            attn.decode_kv_lens = torch.tensor(ctx_lens, dtype=torch.int32)
            if kern is not None:
                attn.decode_block_tables = torch.tensor(padded, dtype=torch.int32)
                attn.decode_rows = torch.tensor(rows if rows is not None else range(len(tables)), dtype=torch.int32)
            else:
                attn.decode_block_tables = torch.tensor(padded if rows is None else [padded[r] for r in rows])
                lens = torch.tensor(ctx_lens)
                attn.decode_mask = (torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]

        for seq, n in batch.prefills if not as_queries else ():
            start = seq.num_computed_tokens
            q_start = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            ctx = start + n
            if kern is not None:
                # The paged kernel reads the context where it lies, whole prompt or chunk, with the
                # arithmetic a decode step does for each query: a token's bits do not depend on how
                # its prompt was split, nor on a prefix-cache hit.
                used = table[: -(-ctx // bs)]  # the blocks holding the context so far
                seg = PrefillSegment(q_start, n, ctx, None, kernel_table=torch.tensor([used], dtype=torch.int32),
                                     kernel_kv_lens=torch.arange(start + 1, ctx + 1, dtype=torch.int32))
            elif start == 0:
                # A whole prompt attends to its own fresh K/V: PyTorch's fused causal SDPA.
                seg = PrefillSegment(q_start, n, ctx, None)
            else:
                used = table[: -(-ctx // bs)]
                seg = PrefillSegment(q_start, n, ctx, torch.tensor(used), chunk_mask(n, ctx))
            attn.prefills.append(seg)
            if ctx == len(seq):
                logit_rows.append(q_start + n - 1)
        if kern is not None and attn.prefills:
            attn.set_prefill_tables()
        attn.slot_mapping = torch.tensor(slots)
        return torch.tensor(ids), torch.tensor(positions), attn, logit_rows

    def _chunks_as_decode_queries(self, batch: ScheduledBatch) -> bool:
        """Whether this step's prefill chunks run as decode queries: a short mixed step (scheduler.py's
        `short_mixed`), on the compiled kernel, and on a model whose native decode stack takes the step.
        Otherwise a few prompt tokens send every decode row of the step through the general path, whose
        per-layer Python and prefill attention cost milliseconds more."""
        return (batch.short_mixed and self.kernels is not None and self.mixed_as_decode and self.model.native_decode
                and self.model.decode_stack() is not None)

    def encode_pieces(self, pieces: list[PlannedPiece]) -> list[torch.Tensor | None]:
        """Run `pieces` (a step's plan: each piece's layers start..stop-1), those of one image with the same
        layers together. A piece through the last layer goes into the encoder cache as embeddings, one
        short of it leaves its hidden state there for its next slice. Returns each piece's embeddings (None
        for one not finished); the time and work count in encoder_seconds / encoder_work."""
        last = self.vision.encoder_layers
        groups: dict[tuple[int, int, int], list[PlannedPiece]] = {}
        for piece in pieces:
            groups.setdefault((id(piece.image), piece.start, piece.stop), []).append(piece)
        done: dict[PlannedPiece, torch.Tensor] = {}
        for (_, start, stop), group in groups.items():
            t0 = time.perf_counter()
            image = group[0].image
            if start == 0:
                if image.prepared is None:  # resized once, kept on the image while its pieces are encoded
                    image.prepared = self.vision.prepare(image.image)
                hidden = self.vision.embed_pieces(image.prepared, [p.index for p in group])
            else:
                hidden = torch.cat([self.encoder_cache.partial(p.key) for p in group])
            hidden = self.vision.run_layers(hidden, start, stop)
            if stop < last:
                for i, piece in enumerate(group):
                    self.encoder_cache.put_partial(piece.key, hidden[i:i + 1].clone() if len(group) > 1 else hidden,
                                                   stop)
            else:
                out = self.vision.finish_pieces(hidden)
                want = sum(p.num_tokens for p in group)
                if out.shape[0] != want:
                    raise ValueError(f"the image's pieces give {out.shape[0]} embeddings for {want} image tokens")
                at = 0
                for piece in group:
                    # A copy of its own: a kept piece must not hold its neighbours' memory once they are evicted.
                    done[piece] = out[at:at + piece.num_tokens].clone() if len(group) > 1 else out
                    self.encoder_cache.put(piece.key, done[piece])
                    at += piece.num_tokens
                    self.encoder_pieces += 1
                    self.encoder_runs += piece.index == 0
                self.encoder_tokens += want
            self.encoder_seconds += time.perf_counter() - t0
            self.encoder_slices += len(group)
            self.encoder_work += sum(p.work for p in group)
        return [done.get(p) for p in pieces]

    def _piece(self, image: ImageInput, index: int) -> torch.Tensor:
        """One piece's embeddings: from the cache (the planner pinned it there), else encoded whole now (a
        batch run again sequence by sequence after a failure has no plan)."""
        found = self.encoder_cache.get((image.content_hash, index))
        if found is not None:
            return found
        return self.encode_pieces([PlannedPiece(image, index, 0, self.vision.encoder_layers)])[0]

    def _image_embeds(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of this step's queries that are image tokens, and their embeddings (None: no image)."""
        if self.vision is None or not any(seq.images for seq, _ in batch.prefills):
            return None
        q = len(batch.decodes) + batch.num_spec_tokens  # prefill queries follow the decodes'
        rows: list[int] = []
        values: list[torch.Tensor] = []
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            for image in seq.images:
                lo, hi = bisect.bisect_left(image.positions, start), bisect.bisect_left(image.positions, start + n)
                if lo >= hi:
                    continue
                rows.extend(q + p - start for p in image.positions[lo:hi])
                size = image.piece_len
                for index in range(lo // size, (hi - 1) // size + 1):
                    first = index * size
                    values.append(self._piece(image, index)[max(lo - first, 0):hi - first])
            q += n
        if not rows:
            return None
        return torch.tensor(rows), torch.cat(values)

    def _argmax_only(self, batch: ScheduledBatch) -> bool:
        """Whether nothing but each row's argmax will be read: every sequence greedy, unconstrained
        and past its min_tokens (the sampler bans stop tokens in the logits before that)."""
        return self.argmax_only_steps and all(
            s.params.greedy and s.params.constraint is None and s.num_output_tokens >= s.params.min_tokens
            and s.params.logprobs is None for s in batch.decodes)

    def _decode_inputs(self, batch: ScheduledBatch) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """A plain decode batch's token ids, positions, K/V slots and block tables, as ints."""
        bs = self.block_size
        ids, positions, slots, tables = [], [], [], []
        for seq in batch.decodes:
            pos = seq.num_computed_tokens
            table = seq.block_table
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table)
        return ids, positions, slots, tables

    def execute(self, batch: ScheduledBatch) -> ForwardResult:
        """Run the batch; returns logits and their row-wise argmax for the sequences that
        produce a token now, and those sequences."""
        sampled = list(batch.decodes) + [s for s, n in batch.prefills if s.num_computed_tokens + n == len(s)]
        if batch.encode:  # slices whose piece is where the plan found it (not yet run by a failed attempt)
            cache = self.encoder_cache
            self.encode_pieces([p for p in batch.encode if p.key not in cache and cache.layers_done(p.key) == p.start])
            if not batch.decodes and not batch.prefills:  # encoder work alone: nothing reads it yet
                return ForwardResult(torch.empty(0), None, sampled)
        # Native code only (no autograd to turn off): every torch call saved counts here, as each
        # step's Python runs on caches the step's weights have just flushed. A plain decode step
        # makes no tensor at all.
        if (self.kernels is not None and batch.decodes and not batch.prefills
                and not any(s.spec_token_ids for s in batch.decodes) and self.model.decodes_tokens()):
            found = self.model.decode_tokens(*self._decode_inputs(batch), self._pools, self.before_forward,
                                             self._argmax_only(batch), interruptible=batch.interruptible)
            if found is None:
                return ForwardResult(torch.empty(0), None, [], interrupted=True)
            logits, argmax, tokens, nan_rows = found
            return ForwardResult(logits, argmax, sampled, picks=GreedyPicks(tokens, nan_rows))
        ids, positions, attn, rows = self._prepare(batch)
        embeds = self._image_embeds(batch)
        # Prompt logprobs are asked of text prompts only (/v1/completions' echo takes no images).
        if embeds is None and (segments := _prompt_segments(batch)):
            return self._with_prompt_logits(batch, ids, positions, attn, rows, segments, sampled)
        if len(rows) == len(ids) and embeds is None:  # every query gives logits: a decode step may take them from the stack
            if self._argmax_only(batch):  # a step checking greedy proposals reads each row's argmax alone
                found = self.model.decode_argmax(ids, positions, attn, self.kv_caches, self.before_forward)
                if found is not None:
                    logits, argmax, tokens, nan_rows = found
                    return ForwardResult(logits, argmax, sampled, picks=GreedyPicks(tokens, nan_rows))
            fused = self.model.decode_logits(ids, positions, attn, self.kv_caches, self.before_forward)
            if fused is not None:
                return ForwardResult(fused[0], fused[1], sampled)
        with torch.inference_mode():
            if self.before_forward is not None:
                self.before_forward()
            # Past the last layer's K/V only the rows that give logits are computed.
            keep = rows if len(rows) < len(ids) else None
            # Image embeddings only where a step has them: a text model's call is what it always was.
            hidden = self.model(ids, positions, attn, self.kv_caches, keep_rows=keep) if embeds is None else \
                self.model(ids, positions, attn, self.kv_caches, keep_rows=keep, embeds=embeds)
            if not rows:
                return ForwardResult(hidden.new_empty(0), None, sampled)
            logits, argmax = self.model.logits_and_argmax(hidden)
            return ForwardResult(logits, argmax, sampled)

    def _with_prompt_logits(self, batch: ScheduledBatch, ids: torch.Tensor, positions: torch.Tensor,
                            attn: AttentionBatch, rows: list[int], segments: list[tuple[Sequence, int, int, int]],
                            sampled: list[Sequence]) -> ForwardResult:
        """The plain forward, keeping the logits of every query of the chunks in `segments` as well."""
        keep = sorted(set(rows).union(*(range(q, q + n) for _, _, q, n in segments)))
        with torch.inference_mode():
            if self.before_forward is not None:
                self.before_forward()
            hidden = self.model(ids, positions, attn, self.kv_caches, keep_rows=keep if len(keep) < len(ids) else None)
            logits, argmax = self.model.logits_and_argmax(hidden)
        where = {row: i for i, row in enumerate(keep)}
        picked = torch.tensor([where[r] for r in rows], dtype=torch.long)
        prompt = [(seq, start, logits[where[q]:where[q] + n]) for seq, start, q, n in segments]
        return ForwardResult(logits[picked], argmax[picked] if argmax is not None else None, sampled,
                             prompt_logits=prompt)


def _prompt_segments(batch: ScheduledBatch) -> list[tuple[Sequence, int, int, int]]:
    """(sequence, first position, first query, length) of each prefill chunk in the batch whose every
    query's logits are asked (the prompt's logprobs), in _prepare's query order."""
    query = len(batch.decodes) + batch.num_spec_tokens
    out = []
    for seq, n in batch.prefills:
        start = seq.num_computed_tokens
        if seq.prompt_logprobs is not None and start < seq.prompt_len:
            out.append((seq, start, query, n))
        query += n
    return out
