"""``rtrl train --now`` (one RL increment by hand) and ``rtrl bootstrap`` (the first champion).

The wiring is services/wiring/trainer.py; this module parses arguments and prints outcomes.
Without ``--corpus``, ``rtrl bootstrap`` trains on the demo world's corpus
(services/sim/users.py), so the demo starts from nothing.

Training runs for minutes with the trainer's own timeouts and retries, so the backends it
needs are checked first, each bounded by ``RTRL_CLI__TIMEOUT_S`` (services/cli/backends.py):
one that is down is one line on stderr and exit code 4 within seconds. The trainer's modules
(torch, Ray) are imported only after that check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.cli import exit_codes
from services.cli.backends import Backend, BackendUnavailableError, message
from services.cli.probes import preflight
from services.runtime.process import setup_logging
from services.settings.model import Settings, get_settings
from services.sim.users import bootstrap_corpus
from trainer.corpus import write_corpus

TRAIN_NEEDS: tuple[Backend, ...] = ("mlflow", "redis", "kafka")
"""An increment reads rewards from Kafka, takes the candidate lock in Redis, logs and
registers in MLflow."""
BOOTSTRAP_NEEDS: tuple[Backend, ...] = ("mlflow",)


def _unreachable(command: str, settings: Settings, backends: tuple[Backend, ...]) -> bool:
    """Check ``backends`` (bounded); print the one line and return True if one is down. Logging
    is set up only afterwards, so the clients' connection warnings stay quiet."""
    try:
        preflight(settings, backends)
    except BackendUnavailableError as exc:
        print(message(command, exc.failure, settings, settings.cli.timeout_s), file=sys.stderr)
        return True
    setup_logging(settings.log_level, "trainer")
    return False


def _train_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl train", description="Run one RL increment now.")
    ap.add_argument("--now", action="store_true", required=True, help="run one increment now")
    ap.add_argument("--json", action="store_true", help="print the outcome as JSON")
    args = ap.parse_args(argv)
    settings = get_settings()
    if _unreachable("train", settings, TRAIN_NEEDS):
        return exit_codes.UNAVAILABLE
    from services.wiring.trainer import BusyError, describe, ray_running, run_once, shutdown_ray

    ray_was_up = ray_running()
    try:
        outcome = run_once(settings)
    except BusyError as exc:
        print(f"rtrl train: {exc}", file=sys.stderr)
        return exit_codes.NOT_DONE
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
    return exit_codes.FAILED if outcome.status == "failed" else exit_codes.OK


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
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="train LoRA adapters on the --hf-model base (this rank) instead of full weights; "
                         "every increment after it trains the adapter")
    ap.add_argument("--lora-alpha", type=int, default=0, help="LoRA alpha (default: twice the rank)")
    ap.add_argument("--lora-targets", default="q_proj,v_proj",
                    help="modules the adapter wraps (comma-separated)")
    ap.add_argument("--force", action="store_true", help="replace an existing champion")
    args = ap.parse_args(argv)
    if args.lora_rank and not args.hf_model:
        ap.error("--lora-rank needs --hf-model (the base model the adapter is trained on)")
    if args.epochs < 0 or (args.epochs == 0 and not args.lora_rank):
        ap.error("--epochs must be positive (0 only with --lora-rank: the base model as it is)")
    settings = get_settings()
    seed = settings.simulator.seed
    if args.write_corpus:
        n = write_corpus(args.write_corpus, bootstrap_corpus(args.records, seed))
        print(f"wrote {n} records to {args.write_corpus}")
        return 0
    if _unreachable("bootstrap", settings, BOOTSTRAP_NEEDS):
        return exit_codes.UNAVAILABLE
    from services.wiring.trainer import bootstrap

    corpus = args.corpus
    if corpus is None:
        corpus = settings.trainer.data_dir / "bootstrap_corpus.jsonl"
        write_corpus(corpus, bootstrap_corpus(args.records, seed))
        print(f"generated the default corpus: {corpus} ({args.records} records)")
    try:
        lora = None
        if args.lora_rank:
            from trainer.lora_policy import LoraSpec

            lora = LoraSpec(args.lora_rank, args.lora_alpha or 2 * args.lora_rank,
                            tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))
        version = bootstrap(settings, corpus, args.epochs, args.lr, args.batch_size,
                            args.hf_model, args.force, lora)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"rtrl bootstrap: {exc}", file=sys.stderr)
        return 1
    print(f"version {version} registered as {settings.mlflow.registered_model}@champion")
    return 0


def main(argv: list[str]) -> int:
    cmd, rest = (argv[0], argv[1:]) if argv else ("train", [])
    if cmd == "bootstrap":
        return _bootstrap_main(rest)
    if cmd == "train":
        return _train_main(rest)
    print(f"unknown trainer command {cmd!r}: use train --now or bootstrap", file=sys.stderr)
    return 2
