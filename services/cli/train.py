"""``rtrl train --now`` (one RL increment by hand) and ``rtrl bootstrap`` (the first champion).

The wiring is services/trainer_job.py; this module parses arguments and prints outcomes.
Without ``--corpus``, ``rtrl bootstrap`` trains on the demo world's corpus
(services/local/sim_users.py), so the demo starts from nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.local.sim_users import bootstrap_corpus
from services.runtime.process import setup_logging
from services.runtime.settings import get_settings
from services.trainer_job import BusyError, bootstrap, describe, ray_running, run_once, shutdown_ray
from trainer.corpus import write_corpus


def _train_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl train", description="Run one RL increment now.")
    ap.add_argument("--now", action="store_true", required=True, help="run one increment now")
    ap.add_argument("--json", action="store_true", help="print the outcome as JSON")
    args = ap.parse_args(argv)
    settings = get_settings()
    ray_was_up = ray_running()
    try:
        outcome = run_once(settings)
    except BusyError as exc:
        print(f"rtrl train: {exc}", file=sys.stderr)
        return 3
    finally:
        if not ray_was_up:  # stop the local Ray this command started, not the caller's
            shutdown_ray()
    body = describe(outcome)
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        line = f"{outcome.status}"
        if outcome.version:
            line += f": version {outcome.version} (parent {outcome.parent}, gate {body['gate']})"
        if outcome.reason:
            line += f" — {outcome.reason}"
        print(line)
    return 1 if outcome.status == "failed" else 0


def _bootstrap_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rtrl bootstrap",
        description="Train the first champion on a corpus (JSON lines of {prompt, completion}).",
    )
    ap.add_argument("--corpus", type=Path, help="corpus file; default: generate the demo corpus")
    ap.add_argument("--write-corpus", type=Path, help="only write the default corpus to this file")
    ap.add_argument("--records", type=int, default=3000, help="size of the generated corpus")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hf-model", help="a local Hugging Face model directory to start from")
    ap.add_argument("--force", action="store_true", help="replace an existing champion")
    args = ap.parse_args(argv)
    settings = get_settings()
    seed = settings.simulator.seed
    if args.write_corpus:
        n = write_corpus(args.write_corpus, bootstrap_corpus(args.records, seed))
        print(f"wrote {n} records to {args.write_corpus}")
        return 0
    corpus = args.corpus
    if corpus is None:
        corpus = settings.trainer.data_dir / "bootstrap_corpus.jsonl"
        write_corpus(corpus, bootstrap_corpus(args.records, seed))
        print(f"generated the default corpus: {corpus} ({args.records} records)")
    try:
        version = bootstrap(settings, corpus, args.epochs, args.lr, args.batch_size,
                            args.hf_model, args.force)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"rtrl bootstrap: {exc}", file=sys.stderr)
        return 1
    print(f"version {version} registered as {settings.mlflow.registered_model}@champion")
    return 0


def main(argv: list[str]) -> int:
    settings = get_settings()
    setup_logging(settings.log_level, "trainer")
    cmd, rest = (argv[0], argv[1:]) if argv else ("train", [])
    if cmd == "bootstrap":
        return _bootstrap_main(rest)
    if cmd == "train":
        return _train_main(rest)
    print(f"unknown trainer command {cmd!r}: use train --now or bootstrap", file=sys.stderr)
    return 2
