"""What kind of answer a chat completion is: the ``completion_kind`` of its exposure event.

The rule, first match wins (docs/gateway.md, "What kind of answer"):

1. ``tool_call``: the answer calls at least one tool, valid or not (how many were invalid
   against the request's ``tools`` is counted beside it, in ``tool_calls`` /
   ``invalid_tool_calls``); any text beside the calls is commentary.
2. ``empty`` (refusal or nothing): the engine marked a refusal (a ``refusal`` message or
   ``finish_reason: content_filter``), or the text is blank.
3. ``edit``: the text holds a fenced code block (a line opening with three backticks or tildes):
   it proposes code, whatever question follows it.
4. ``empty``: a refusal in prose (:func:`refuses`): a short text that opens by declining and
   offers nothing else.
5. ``question``: the text's last line ends with ``?``, or its first word is an interrogative
   (:data:`QUESTION_WORDS`, the word a simulated user also reads as a question,
   services/sim/chat_world.py): it asks instead of answering.
6. ``edit``: any other text answers the request.

Pure: text in, kind out; :func:`answer_fields` gives an exposure event its answer fields.
"""

from __future__ import annotations

import re
import string
from typing import Any, Literal, Protocol

from services.gateway.chat import calls

AnswerKind = Literal["edit", "question", "empty", "tool_call"]

QUESTION_WORDS = frozenset({"which", "what", "where", "when", "who", "whom", "whose", "why", "how"})
"""First words that make an answer without code a clarifying question."""
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)

REFUSAL_MAX_CHARS = 280
"""A prose refusal is at most this long (stripped): a longer text that opens by declining goes on
to say something, and is read by the other rules."""
_APOLOGY = r"(?:(?:i'm|i am) (?:sorry|afraid)|sorry|i apologi[sz]e|unfortunately)[,.;:!]? (?:but )?"
_NOT = (r"i(?: can't| cannot| can not| won't| will not| won't be able to| will not be able to"
        r"| am unable to|'m unable to| am not able to|'m not able to| am not going to|'m not going to)")
_VERB = r" (?:help|assist|comply|fulfil|fulfill|provide|do that|do this|support)\b"
_DECLINE = r"i(?: must| have to| will have to|'ll have to) (?:decline|refuse)\b"
_AS_AI = r"as an ai(?: language model| model| assistant)?,? "
_REFUSAL = re.compile(rf"(?:{_APOLOGY})?(?:{_NOT}{_VERB}|{_DECLINE})|{_AS_AI}{_NOT}\b")
"""Refusal openings, on lower-cased text with one space between words and straight apostrophes:
"I can't help", "I'm sorry, but I cannot provide", "I must decline", "As an AI, I won't"."""
_OFFER = re.compile(r"\b(?:but|however|instead)\b")
"""After the opening, a word that offers something else ("but here is", "instead, use")."""


def answer_kind(text: str, tool_calls: int = 0, refusal: str | None = None,
                finish_reason: str | None = None) -> AnswerKind:
    """The kind of one chat answer (the rule of the module docstring)."""
    if tool_calls > 0:
        return "tool_call"
    if refusal or finish_reason == "content_filter" or not text.strip():
        return "empty"
    if _FENCE.search(text):
        return "edit"
    if refuses(text):
        return "empty"
    if text.rstrip().endswith("?"):
        return "question"
    if text.split(None, 1)[0].strip(string.punctuation).lower() in QUESTION_WORDS:
        return "question"
    return "edit"


def refuses(text: str) -> bool:
    """A refusal in prose: the text is at most :data:`REFUSAL_MAX_CHARS` long, opens (after
    markdown emphasis or quotes) with a refusal opening (:data:`_REFUSAL`), the sentence of
    that opening does not end in ``?`` (then it asks), and nothing after the opening offers
    something else (:data:`_OFFER`). Deliberately narrow: a refusal it misses reads as an
    edit or a question."""
    if len(text.strip()) > REFUSAL_MAX_CHARS:
        return False
    plain = " ".join(text.replace("\u2019", "'").lower().split()).lstrip("*_>\"' ")
    opening = _REFUSAL.match(plain)
    if opening is None:
        return False
    rest = plain[opening.end():]
    end = re.search(r"[.!?]", rest)
    return not (end is not None and end.group() == "?") and _OFFER.search(rest) is None


class Answer(Protocol):
    """What :func:`answer_fields` reads of a served answer (services/gateway/generation.Served)."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def text(self) -> str: ...

    @property
    def refusal(self) -> str | None: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def tool_calls(self) -> list[dict[str, Any]]: ...


def answer_fields(chat: bool, served: Answer, verdicts: list[calls.Invalid | None]) -> dict[str, Any]:
    """The exposure event's ``tool_calls``, ``invalid_tool_calls`` and ``completion_kind``:
    a chat answer's calls with their verdicts (services/gateway/chat/calls.py), its kind by
    the rule above. A completion makes no calls: its text is classified by the same rule,
    except token ids served without any text (a token-id policy has no tokenizer), which
    cannot be read and stay an ``edit``."""
    if not chat:
        unread = bool(served.tokens) and not served.text and served.finish_reason != "content_filter"
        kind = "edit" if unread else answer_kind(served.text, 0, served.refusal, served.finish_reason)
        return {"tool_calls": 0, "invalid_tool_calls": 0, "completion_kind": kind}
    made, invalid = calls.tally(served.tool_calls, verdicts)
    kind = answer_kind(served.text, made, served.refusal, served.finish_reason)
    return {"tool_calls": made, "invalid_tool_calls": invalid, "completion_kind": kind}
