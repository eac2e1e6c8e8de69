"""The default policy's vocabulary conventions, shared by the gateway, simulator and trainer.

Real deployments use their model's tokenizer; these ids matter only for the default small
policy and the simulated users. A completion that starts with ``ASK`` is a clarifying
question rather than an edit; one that starts with ``EOS`` (or is empty) proposes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

VOCAB_SIZE = 64
BOS = 0
"""Begins every prompt."""
EOS = 1
"""Ends a completion."""
ASK = 2
"""First token of a clarifying question instead of an edit."""
FIRST_CONTENT = 3
"""Token ids FIRST_CONTENT .. VOCAB_SIZE-1 are content."""

CompletionKind = Literal["edit", "question", "empty"]


def completion_kind(tokens: Sequence[int]) -> CompletionKind:
    """What a completion proposes, from its tokens."""
    if not tokens or tokens[0] == EOS:
        return "empty"
    if tokens[0] == ASK:
        return "question"
    return "edit"


def content(tokens: Sequence[int]) -> list[int]:
    """The completion's tokens up to (not including) EOS."""
    out = []
    for t in tokens:
        if t == EOS:
            break
        out.append(t)
    return out
