"""What kind of answer a chat completion is: the ``completion_kind`` of its exposure event.

The rule, first match wins (docs/gateway.md, "What kind of answer"):

1. ``tool_call``: the answer calls at least one tool, valid or not (how many were invalid
   against the request's ``tools`` is counted beside it, in ``tool_calls`` /
   ``invalid_tool_calls``); any text beside the calls is commentary.
2. ``empty`` (refusal or nothing): the engine marked a refusal (a ``refusal`` message or
   ``finish_reason: content_filter``), or the text is blank.
3. ``edit``: the text holds a fenced code block (a line opening with three backticks or tildes):
   it proposes code, whatever question follows it.
4. ``question``: the text's last line ends with ``?``, or its first word is an interrogative
   (:data:`QUESTION_WORDS`, the word a simulated user also reads as a question,
   services/sim/chat_world.py): it asks instead of answering.
5. ``edit``: any other text answers the request.

Pure: text in, kind out. Refusals phrased in prose ("I can't help with that") are not
guessed at: they read as ``edit`` or ``question`` by the rules above.
"""

from __future__ import annotations

import re
import string
from typing import Literal

AnswerKind = Literal["edit", "question", "empty", "tool_call"]

QUESTION_WORDS = frozenset({"which", "what", "where", "when", "who", "whom", "whose", "why", "how"})
"""First words that make an answer without code a clarifying question."""
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)


def answer_kind(text: str, tool_calls: int = 0, refusal: str | None = None,
                finish_reason: str | None = None) -> AnswerKind:
    """The kind of one chat answer (the rule of the module docstring)."""
    if tool_calls > 0:
        return "tool_call"
    if refusal or finish_reason == "content_filter" or not text.strip():
        return "empty"
    if _FENCE.search(text):
        return "edit"
    if text.rstrip().endswith("?"):
        return "question"
    if text.split(None, 1)[0].strip(string.punctuation).lower() in QUESTION_WORDS:
        return "question"
    return "edit"
