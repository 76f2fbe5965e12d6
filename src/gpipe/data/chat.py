"""Records as tokens with their answers marked: what :class:`~gpipe.data.instruct.InstructionData`
trains on and ``gpipe generate --chat`` prompts with.

A prompt/completion record is ``BOS? prompt completion EOS`` (each tokenized alone, so the answer's
first token is exactly where the completion starts), the answer the completion and EOS. A chat is
rendered with the tokenizer's chat template (transformers' ``apply_chat_template``, the Jinja
sandbox transformers renders with) and tokenized whole; its answers are the assistant turns, found
as text: the conversation rendered up to an assistant turn with the generation prompt, and through
it, must each begin the whole rendering, and the characters between the two are that turn's answer
(its content and the template's end of turn, which the model learns to write). A token is an
answer's when it starts inside one (the tokenizer's offsets). A template that renders a
conversation's beginning unlike the whole (one that drops earlier turns' reasoning, say) is refused
for that record: no answer is guessed.

transformers is not imported here: the tokenizer (:class:`~gpipe.data.tokenizer.HFTokenizer`) comes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpipe.data.records import Record, RecordError
from gpipe.data.text import Tokenizer

__all__ = ["Encoded", "Encoder", "TemplateError"]


class TemplateError(ValueError):
    """Chat records, and a tokenizer without a chat template."""


@dataclass(frozen=True)
class Encoded:
    """A record's tokens, which of them are its answers', and where it came from."""

    tokens: list[int]
    answer: list[bool]
    where: str


class Encoder:
    """Turns :class:`~gpipe.data.records.Record` s into :class:`Encoded` with ``tokenizer`` (a
    SentencePiece vocabulary or a ``tokenizer.json``; chats need the latter, with a chat template)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template: str | None = getattr(tokenizer, "chat_template", None)

    def encode(self, record: Record) -> Encoded:
        if record.messages is None:
            assert record.prompt is not None and record.completion is not None
            first = [] if self.tokenizer.bos is None else [self.tokenizer.bos]
            last = [] if self.tokenizer.eos is None else [self.tokenizer.eos]
            prompt, completion = self.tokenizer.encode_lines([record.prompt, record.completion])
            if not completion:
                raise RecordError(record.where, "an empty answer", " (the completion has no tokens)")
            tokens = [*first, *prompt, *completion, *last]
            return Encoded(
                tokens, [False] * (len(first) + len(prompt)) + [True] * (len(completion) + len(last)), record.where
            )
        return self._chat(record)

    def prompt(self, messages: list[tuple[str, str]]) -> list[int]:
        """The tokens of ``messages`` rendered with the generation prompt: what a model answers."""
        ids, _ = self._tokens(self._render(messages, "a prompt", generation=True))
        return ids

    # -- chats ---------------------------------------------------------------------------------------
    def _fast(self) -> Any:
        fast = getattr(self.tokenizer, "tokenizer", None)
        if fast is None or not callable(getattr(fast, "apply_chat_template", None)):
            raise TemplateError(
                "chat records are rendered with a transformers tokenizer's chat template; the tokenizer is a "
                "SentencePiece model: give a tokenizer.json (--tokenizer, or --init's folder)"
            )
        return fast

    def _render(
        self, messages: list[tuple[str, str]] | tuple[tuple[str, str], ...], where: str, *, generation: bool
    ) -> str:
        if self.template is None:
            raise TemplateError(
                f"{where}: a chat, and the tokenizer has no chat template (no chat_template in its "
                "tokenizer_config.json, no chat_template.jinja beside it): give one with --chat-template FILE (Jinja)"
            )
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            text = self._fast().apply_chat_template(
                conversation, chat_template=self.template, tokenize=False, add_generation_prompt=generation
            )
        except TemplateError:
            raise
        except Exception as exc:  # (the template's own raise_exception, a Jinja error)
            raise RecordError(where, "refused by the chat template", f" ({' '.join(str(exc).split())})") from None
        return str(text)

    def _tokens(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = self._fast()(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]

    def _chat(self, record: Record) -> Encoded:
        messages = record.messages
        assert messages is not None
        whole = self._render(messages, record.where, generation=False)
        spans = []
        for i, (role, _) in enumerate(messages):
            if role != "assistant":
                continue
            before = self._render(messages[:i], record.where, generation=True) if i else ""
            through = self._render(messages[: i + 1], record.where, generation=False)
            if not (whole.startswith(through) and through.startswith(before)):
                raise RecordError(
                    record.where,
                    "a chat the template renders unlike its beginning",
                    f" (the conversation through message {i + 1}, the assistant's, does not begin the whole: the "
                    "answer's tokens cannot be told)",
                )
            spans.append((len(before), len(through)))
        ids, offsets = self._tokens(whole)
        answer = [any(a <= start < b for a, b in spans) for start, _ in offsets]
        if not any(answer):
            raise RecordError(record.where, "an empty answer", " (the assistant turns render to no tokens)")
        return Encoded(ids, answer, record.where)
