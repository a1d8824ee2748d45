"""Chat messages -> token ids, for episodes.

A prompt of messages is rendered by the tokenizer's chat template (with the tools' schemas) and tokenised as the
dataset tokenises prompts. An observation's tokens are rendered against a fixed base conversation, not against the
episode's history (as SkyRL, TRL and verl do): render ``BASE + new messages`` with the generation prompt, keep the
text after the rendering of ``BASE`` alone. The history is never rendered again, so a template that rewrites earlier
turns (Qwen3 drops earlier ``<think>`` blocks) cannot change tokens the model already produced, and the sampled
tokens are never re-encoded."""

from __future__ import annotations

BASE = [{"role": "system", "content": "megarl"}, {"role": "user", "content": "megarl"}]
"""The conversation observations are rendered after (a system and a user message, so no template adds its own)."""


class TemplateError(ValueError):
    """The chat template cannot render an observation's messages on their own."""


class Renderer:
    """Token ids of prompts and observations for one tokenizer (see the module's doc)."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("env: the tokenizer has no chat template; an environment's messages need one (use a "
                                "model whose tokenizer has one, e.g. an -Instruct model)")  # fmt: skip
        self.tokenizer = tokenizer
        self.base = self._text(BASE, generation_prompt=False)
        self.observation_ids([{"role": "user", "content": "?"}])  # refused now rather than mid-run

    def _text(self, messages: list[dict], *, generation_prompt: bool, tools=None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False)  # fmt: skip

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, first, dataset_ids: list[int], tools=None) -> list[int]:
        """An episode's first prompt: ``first`` (reset's value) rendered; None keeps the dataset's tokens."""
        if first is None:
            return list(dataset_ids)
        if isinstance(first, str):
            return self.encode(first)
        return self.encode(self._text(first, generation_prompt=True, tools=tools))

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The tokens that follow a model turn for ``messages``, ending with the generation prompt."""
        whole = self._text(BASE + messages, generation_prompt=True)
        if not whole.startswith(self.base):
            raise TemplateError(
                "env: the chat template renders a conversation's first messages differently once more follow "
                f"({self.base[-40:]!r} is not a prefix of the longer rendering); observations cannot be rendered "
                "on their own with it"
            )
        return self.encode(whole[len(self.base) :])
