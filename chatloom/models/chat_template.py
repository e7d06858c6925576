"""Render a model's own Jinja chat template."""
from __future__ import annotations

from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatloom.models.config import ModelError

# Used only when a model ships no template of its own.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template, ready for the reply.
    The one place prompts are encoded from messages (the CLI, the benchmarks, the local backend)."""
    text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    # A template that writes the BOS text itself must not get a second BOS from the encoder.
    return tokenizer.encode(text, add_special=not (tokenizer.bos_token and text.startswith(tokenizer.bos_token)))


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for `messages` ([{"role", "content"}]), ending ready for the reply."""
    try:
        return _compile(template or FALLBACK_TEMPLATE).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token)
    except TemplateError as exc:
        raise ModelError(f"chat template failed: {exc}") from None
