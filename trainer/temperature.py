"""Log-probabilities at a sampling temperature: the distribution a served token was drawn from.

A completion sampled at temperature ``T`` draws each token from ``softmax(z / T)`` over the
logits ``z``, and the serving layer logs the log-probability of that distribution: the built-in
policies do (``trainer/policy.py``), and so does vLLM started with ``--logprobs-mode
processed_logprobs`` (``services/stack/engine.py``), whose sampler divides the logits by the
request's temperature before it takes ``log_softmax``. To compare its own numbers with those
(the train-inference mismatch, ``trainer/mismatch.py``) the trainer scores each record at the
temperature it was served with::

    log π_T(token) = log_softmax(z / T)[token]

A greedy request (``T`` below vLLM's 1e-5) is not divided at all: vLLM logs the model's
log-probabilities at temperature 1, and :func:`scoring_temperature` says so. Top-k/top-p
truncation, penalties and logit biases are not reproduced here (docs/trainer.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional torch alias)
from torch import Tensor

GREEDY_BELOW = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a request with a lower temperature is sampled greedily."""


def scoring_temperature(served: float) -> float:
    """The temperature at which the log-probabilities of a completion served at ``served``
    were logged: ``served`` itself, or 1 for a greedy request."""
    return 1.0 if served < GREEDY_BELOW else served


def temperature_column(served: Sequence[float] | None) -> Tensor | None:
    """One scoring temperature per row as a float tensor [B]; None when every row is at 1
    (nothing to divide)."""
    if served is None:
        return None
    temps = [scoring_temperature(t) for t in served]
    return None if all(t == 1.0 for t in temps) else torch.tensor(temps, dtype=torch.float32)


def tempered_log_softmax(logits: Tensor, temperatures: Tensor | None = None) -> Tensor:
    """``log_softmax(logits / T)`` over the last dimension, in float32; ``temperatures`` holds
    one temperature per row of ``logits`` (its first dimension); None: temperature 1."""
    z = logits.float()
    if temperatures is not None:
        z = z / temperatures.to(z).reshape(-1, *([1] * (z.dim() - 1)))
    return F.log_softmax(z, dim=-1)
