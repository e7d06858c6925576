"""Speculative decoding: a cheap proposer guesses the next tokens, the target model checks
them all in one forward pass inside the ordinary continuous batch, and the output is
exactly what the target alone would give (greedy: the same tokens; sampled: the same
distribution, by the rejection rule with residual resampling).

proposer.py   the interface and the n-gram (prompt lookup) proposer
draft.py      the draft-model proposer, with its own paged KV cache kept in step
rejection.py  the acceptance rules: greedy exact match, and min(1, p/q) with residual resampling
verify.py     a step's logits rows into each sequence's kept tokens, by those rules
planner.py    how many tokens to propose per sequence this step (or none): acceptance
              rates against the measured cost of a step
decoder.py    the piece the engine talks to, and the counters behind /metrics
"""
from chatloom.engine.spec_decode.decoder import SpecDecodeStats, SpeculativeDecoder, build_speculative_decoder

__all__ = ["SpecDecodeStats", "SpeculativeDecoder", "build_speculative_decoder"]
