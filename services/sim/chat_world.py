"""The simulated world in words, for users who speak chat to a real LLM (``rtrl demo --engine vllm``).

The world of services/sim/users.py is defined over the built-in policy's token ids
(trainer/tokens.py). Here each of those ids is a word: a task's marker is the word that
names it, its preferred tokens are the words its users keep, ``ASK`` is the word a
clarifying question starts with. A simulated user

* writes its prompt as a chat message, the words of ``[marker, context...]``
  (:meth:`ChatVocab.message`);
* reads the model's answer as text, word by word (:meth:`ChatVocab.read`): a known word is
  its id; any other word (a fragment, a misspelling, punctuation) is a word no task wants;
  an answer that starts with the question word is a question, an empty one proposes nothing.

So the user reacts to what it reads, never to the engine's token ids; the model (whatever
its tokenizer) must learn to write the words users keep, in the number they need. The
demo's tokenizer is trained so that each word, after a space, is one token
(services/demo/chat_model.py), which keeps the tiny model's task small, not possible.

Pure: no tokenizer, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.sim.users import World
from trainer.tokens import ASK, BOS, FIRST_CONTENT, VOCAB_SIZE, content

CONTENT_WORDS: tuple[str, ...] = (
    "add", "arg", "bar", "buf", "call", "cast", "char", "copy", "data", "def", "dict", "diff",
    "doc", "else", "enum", "eval", "exit", "file", "find", "flag", "foo", "func", "hash", "head",
    "heap", "init", "int", "item", "iter", "join", "json", "key", "len", "line", "list", "load",
    "lock", "log", "loop", "map", "node", "null", "pair", "path", "pipe", "pop", "port", "push",
    "read", "root", "row", "run", "seq", "set", "sort", "span", "stack", "str", "sum", "tail",
    "test",
)
"""The words of content ids FIRST_CONTENT .. VOCAB_SIZE-1, in order."""
ASK_WORD = "which"
"""A completion whose first word is this is a clarifying question."""

if len(CONTENT_WORDS) != VOCAB_SIZE - FIRST_CONTENT or len(set(CONTENT_WORDS)) != len(CONTENT_WORDS):
    raise ImportError("chat_world: one distinct word per content id is needed")


@dataclass(frozen=True)
class ChatVocab:
    """Words <-> the world's token ids, for one world (its tasks decide which word is unwanted)."""

    world: World

    @property
    def unwanted(self) -> int:
        """The id an unknown word reads as: the first task's marker, which no task prefers
        (markers are never drawn as preferred tokens)."""
        return self.world.tasks[0].marker

    @staticmethod
    def word(token: int) -> str:
        if token == ASK:
            return ASK_WORD
        if not FIRST_CONTENT <= token < VOCAB_SIZE:
            raise ValueError(f"token {token} has no word (BOS and EOS are not written)")
        return CONTENT_WORDS[token - FIRST_CONTENT]

    def message(self, prompt: Sequence[int]) -> str:
        """The chat message of a world prompt ``[BOS, marker, context...]``."""
        return " ".join(self.word(t) for t in prompt if t != BOS)

    def text(self, completion: Sequence[int]) -> str:
        """A completion written out (up to EOS), as a model should answer it."""
        return " ".join(self.word(t) for t in content(completion))

    def read(self, text: str) -> list[int]:
        """The world ids of an answer as a user reads it: one per whitespace-separated word,
        unknown words as :attr:`unwanted`; ``ASK`` first when it starts with the question word;
        ``[]`` for an empty answer."""
        ids = []
        for i, w in enumerate(text.split()):
            if i == 0 and w.lower().strip("?,.:") == ASK_WORD:
                ids.append(ASK)
            else:
                ids.append(_IDS.get(w, self.unwanted))
        return ids


_IDS = {w: FIRST_CONTENT + i for i, w in enumerate(CONTENT_WORDS)}
