"""Constrained decoding: a per-request logits mask from a grammar (JSON, JSON schema, regex, choices).

`Constraint` is what a request asks for (plain data, checked when the request is made);
`GrammarGuide` is the engine's side: one matcher per constrained sequence, their masks computed
together each step and applied to those rows only, so constrained and free requests share a batch.
Import from the modules (constraint, guide): this file imports nothing, so sampling_params can
import constraint without a circle. The grammar work is llguidance's (a maintained Rust library); see README "Structured output" for why.
"""
