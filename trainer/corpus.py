"""The bootstrap corpus: JSON lines of ``{"prompt": [ids...], "completion": [ids...]}``.

``rtrl bootstrap`` trains the first champion on it with supervised next-token training on
the completion tokens given their prompt. Blank lines and lines starting with ``#`` are
ignored; any other malformed line is an error naming its line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def read_corpus(path: str | Path, vocab_size: int | None = None) -> list[tuple[list[int], list[int]]]:
    pairs = []
    with Path(path).open() as fh:
        for n, line in enumerate(fh, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                row = json.loads(line)
                prompt, completion = row["prompt"], row["completion"]
                tokens = [*prompt, *completion]
                if not completion or not all(isinstance(t, int) and t >= 0 for t in tokens):
                    raise ValueError("prompt and completion: lists of ints >= 0, completion non-empty")
                if vocab_size is not None and max(tokens) >= vocab_size:
                    raise ValueError(f"token id {max(tokens)} outside the vocabulary (size {vocab_size})")
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: {exc}") from exc
            pairs.append((list(prompt), list(completion)))
    if not pairs:
        raise ValueError(f"{path}: the corpus is empty")
    return pairs


def write_corpus(path: str | Path, pairs: Iterable[tuple[list[int], list[int]]]) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as fh:
        for prompt, completion in pairs:
            fh.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            n += 1
    return n
