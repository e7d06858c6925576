"""Images in the engine: what the encoder cache and the prefix cache save on a second question about
the same image, and what encoding images costs text-only users' streams.

1. TTFT of a first question about a new image (encoder and the whole prefill) against a second question
   about the same image (its embeddings and KV blocks reused), in alternating rounds, each round with a
   fresh image.
2. The inter-token latency (p90 and mean) of `streams` text-only requests decoding together, alone and
   while requests with new images arrive (one every `image_every` steps), alternating quiet and busy
   rounds, with the encoder work done meanwhile (engine/encoder_plan.py paces it): pieces finished,
   slices of their layers run, and that work in whole pieces.

Run with a real vision checkpoint: `chatloom bench vision --model PATH`.
"""
from __future__ import annotations

import io
import statistics
import time

import numpy as np
from PIL import Image

from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.loader import LoadedModel
from chatloom.serving.images import IMAGE_MARKER, encode_vision_chat, read_image

QUESTIONS = ("Describe this picture in one sentence.", "What colours are most common in it?")
TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _image(side: int, seed: int):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return read_image(buf.getvalue(), side * side + 1)


def _prompt(loaded: LoadedModel, text: str, image=None):
    message = {"role": "user", "content": (IMAGE_MARKER if image else "") + text, "images": [image] if image else []}
    return encode_vision_chat(loaded, [message])


def _ttft(engine: LLMEngine, loaded: LoadedModel, text: str, image) -> float:
    ids, placed = _prompt(loaded, text, image)
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1), images=placed)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.metrics.ttft


def _text_streams(engine: LLMEngine, loaded: LoadedModel, streams: int, max_tokens: int, image_every: int,
                  seed: int) -> dict:
    """`streams` text-only requests decoding together, with a request about a new image arriving every
    `image_every` steps (0: none): their inter-token gaps' p90 and mean, and the encoder work done while
    they ran. Image requests still waiting for their encoder when the streams end are aborted: what
    they would cost after that is no stream's."""
    ids, _ = _prompt(loaded, TEXT)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # The image requests are made beforehand: a server decodes uploads outside the engine's steps.
    pending = [_prompt(loaded, QUESTIONS[0], _image(512, seed * 1000 + i))
               for i in range(max_tokens // image_every + 1 if image_every else 0)]
    text_ids = {engine.add_request(ids, params) for _ in range(streams)}
    image_ids: list[str] = []
    last: dict[str, float] = {}
    gaps: list[float] = []
    step = 0
    runner = engine.runner
    pieces, slices, work = runner.encoder_pieces, runner.encoder_slices, runner.encoder_work
    encoder_s, started = runner.encoder_seconds, time.perf_counter()
    while text_ids:
        if image_every and step % image_every == 0 and pending:
            img_ids, placed = pending.pop()
            image_ids.append(engine.add_request(img_ids, SamplingParams(temperature=0.0, max_tokens=1),
                                                images=placed))
        outs = engine.step()
        now = time.perf_counter()
        step += 1
        for out in outs:
            if out.request_id in text_ids:
                if out.request_id in last and out.delta_token_ids:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
                if out.finished:
                    text_ids.discard(out.request_id)
    wall = time.perf_counter() - started
    pieces, encoder_s = runner.encoder_pieces - pieces, runner.encoder_seconds - encoder_s
    slices, work = runner.encoder_slices - slices, runner.encoder_work - work
    for rid in image_ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"itl_p90_s": float(np.percentile(gaps, 90)) if gaps else 0.0,
            "itl_mean_s": float(np.mean(gaps)) if gaps else 0.0,
            "image_requests": len(image_ids), "encoder_pieces": pieces, "encoder_slices": slices,
            "encoder_work": work, "encoder_s": encoder_s, "wall_s": wall}


def run_vision(loaded: LoadedModel, rounds: int = 4, streams: int = 4, max_tokens: int = 32,
               image_every: int = 4, image_side: int = 512, seed: int = 0,
               config: EngineConfig | None = None) -> dict:
    if loaded.vision is None:
        raise ValueError(f"model {loaded.id} does not take images: give a vision checkpoint (Idefics3 / SmolVLM)")
    engine = LLMEngine(loaded, config or EngineConfig())
    cold, warm = [], []
    for r in range(rounds):
        image = _image(image_side, seed + r)
        cold.append(_ttft(engine, loaded, QUESTIONS[0], image))
        warm.append(_ttft(engine, loaded, QUESTIONS[1], image))
    quiet, busy = [], []
    # Alternated, as quiet-busy then busy-quiet pairs: the machine's load changes from minute to minute,
    # and a load that keeps rising (or falling) would otherwise count against (or for) the busy rounds.
    order = []
    for r in range(rounds):
        first_quiet = r % 2 == 0
        for images in (False, True) if first_quiet else (True, False):
            order.append("busy" if images else "quiet")
            if images:
                busy.append(_text_streams(engine, loaded, streams, max_tokens, image_every, seed + 1 + r))
            else:
                quiet.append(_text_streams(engine, loaded, streams, max_tokens, 0, seed))
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    quiet_s, busy_s = median(quiet, "itl_p90_s"), median(busy, "itl_p90_s")
    quiet_mean, busy_mean = median(quiet, "itl_mean_s"), median(busy, "itl_mean_s")
    wall = sum(run["wall_s"] for run in busy)
    piece_work = loaded.vision.piece_tokens * loaded.vision.encoder_layers  # one whole piece, in embedding-layers
    return {
        "benchmark": "vision", "model": loaded.id, "rounds": rounds, "image_side": image_side,
        "image_tokens": loaded.vision.num_image_tokens(image_side, image_side),
        "encoder_max_slowdown": engine.config.encoder_max_slowdown,
        "ttft": {"first_question_s": cold_s, "second_question_s": warm_s,
                 "speedup": cold_s / warm_s if warm_s else None},
        "text_streams": {"streams": streams, "image_every_steps": image_every,
                         "itl_p90_quiet_s": quiet_s, "itl_p90_with_images_s": busy_s,
                         "rise": busy_s / quiet_s - 1 if quiet_s else None,
                         "itl_mean_quiet_s": quiet_mean, "itl_mean_with_images_s": busy_mean,
                         "mean_rise": busy_mean / quiet_mean - 1 if quiet_mean else None,
                         # The encoder work done while the streams ran (all busy rounds together).
                         "image_requests": sum(run["image_requests"] for run in busy),
                         "encoder_pieces": sum(run["encoder_pieces"] for run in busy),
                         # Slices of pieces' encoder layers run, and their work in whole pieces.
                         "encoder_slices": sum(run["encoder_slices"] for run in busy),
                         "encoder_piece_equivalents": sum(run["encoder_work"] for run in busy) / piece_work,
                         "encoder_share": sum(run["encoder_s"] for run in busy) / wall if wall else None,
                         # Each round's p90, in the order each kind ran: how far the load moved them.
                         "round_order": order,
                         "itl_p90_quiet_rounds_s": [run["itl_p90_s"] for run in quiet],
                         "itl_p90_with_images_rounds_s": [run["itl_p90_s"] for run in busy]},
        "encoder_runs": engine.runner.encoder_runs,
        "encoder_pieces": engine.runner.encoder_pieces,
    }
