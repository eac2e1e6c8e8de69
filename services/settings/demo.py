"""Settings of the simulated users and of ``rtrl demo``: the embedded closed loop's knobs,
apart from the services' own sections (services/settings/services.py). Each field's
docstring is its documentation (docs/configuration.md is generated from them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr

from services.settings.services import Section

BUILTIN_LOOP_MINUTES = 12.0
"""The loop's default budget on the built-in policy."""
VLLM_LOOP_MINUTES = 20.0
"""The loop's default budget on vLLM (``engine = vllm``)."""
BUILTIN_SIM_USERS = 300
"""The demo's simulated users on the built-in policy (and under ``agent``)."""
VLLM_SIM_USERS = 1000
"""The same on vLLM, one-shot: its canaries need more users than 300 hold (``sim_users``)."""
BUILTIN_HOLDOUT_MEASURE_S = 60.0
"""How long the built-in policy's last champion is measured against the holdout after the loop."""
VLLM_HOLDOUT_MEASURE_S = 300.0
"""The same on vLLM: about 1,000 more holdout requests at the demo's rate."""


class SimulatorSettings(Section):
    """Simulated users (``rtrl serve simulator``): they call the gateway and send the client
    events of the contract (accept/reject, persistence at horizons, dissatisfied follow-ups)."""

    gateway_url: str = "http://127.0.0.1:8080"
    """Base URL of the gateway's HTTP API."""
    seed: int = 0
    """Seeds the world (tasks, preferences), the population and every reaction."""
    api: Literal["tokens", "chat"] = "tokens"
    """``tokens``: the token-id API with the built-in policy's vocabulary; ``chat``: OpenAI
    chat completions, prompts and answers in words (services/sim/chat_world.py), for a
    gateway in front of a real LLM (``rtrl demo --engine vllm``)."""
    agent: bool = False
    """Agent sessions instead of one-shot asks: users with multi-step tasks that need tools
    (search, edit, run), one request per turn naming its session and turn (token ids, or
    with ``api = chat`` a chat message in words), who abandon sessions that loop, stall or
    break tools (services/sim/agent.py). Needs a reward spec with a ``[session]`` table
    (``agent.toml``); ``max_requests`` then counts sessions."""
    n_users: int = 200
    """Simulated users; each has a user_key, a type from the mix and hidden preferences."""
    user_mix: dict[str, float] = Field(default_factory=dict)
    """Overrides of the user types' shares by name (patient, typical, impatient),
    e.g. RTRL_SIMULATOR__USER_MIX='{"impatient": 0.6}'. Empty: the default mix."""
    ambiguous_share: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """Share of requests on ambiguous tasks, where asking a question beats guessing."""
    concurrency: Annotated[int, Field(ge=1)] = 4
    """Requests in flight at once (one thread each)."""
    rate_per_s: Annotated[float, Field(ge=0.0)] = 20.0
    """Target requests per second over all users; 0: as fast as the gateway answers."""
    max_tokens: Annotated[int, Field(ge=1, le=256)] = 24
    """Most tokens a simulated user asks for per completion."""
    temperature: Annotated[float, Field(gt=0.0)] = 1.0
    """Sampling temperature the simulated users request."""
    time_scale: Annotated[float, Field(gt=0.0)] = 1.0
    """Multiplies the reward spec's horizons and the users' delays (same meaning as
    ``reward.time_scale``; set both to the same value): 0.005 sends the 1 h persistence
    report 18 s after the edit."""
    accept_delay_s: Annotated[float, Field(ge=0.0)] = 2.0
    """Seconds (before time_scale) between a completion and the user's accept/reject."""
    followup_delay_s: Annotated[float, Field(ge=0.0)] = 20.0
    """Seconds (before time_scale) between the reaction and a dissatisfied follow-up."""
    max_requests: Annotated[int, Field(ge=0)] = 0
    """Stop after this many requests (0: run until stopped)."""
    request_timeout_s: float = 10.0
    """How long a simulated user waits for the gateway's answer before counting an error."""
    api_key: SecretStr | None = None
    """The gateway API key the simulated users send (``Authorization: Bearer``)."""
    key_id: str | None = "simulator"
    """Key id that signs the client events; None sends them unsigned (development)."""
    secret: SecretStr | None = None
    """Signing secret; None: the secret of ``key_id`` in ``auth.keys``."""


class DemoSettings(Section):
    """``rtrl demo``: the closed loop on an embedded stack (flags override these)."""

    data_dir: Path = Path(".rtrl/demo")
    """The demo's own stack, registry and logs; wiped at the start of each run."""
    report_dir: Path = Path("reports")
    """Where the demo writes its report (figures, decisions, the reconcile result)."""
    loop_minutes: Annotated[float, Field(gt=0.0)] | None = None
    """The loop's own budget: it runs this long once the stack, the bootstrap (and, with
    ``--engine vllm``, the engine) are up, however long they took; stopping and the report
    follow (about a minute). Unset: 12 minutes on the built-in policy, 20 on vLLM, whose
    LoRA increments take 3-5 minutes each to train on the 2 cores the engine shares."""
    minutes: Annotated[float, Field(gt=0.0)] | None = None
    """A budget for the whole demo instead, from the stack's start until it is stopped: the
    loop then gets what the setup leaves (at most that less a reserve for stopping), not
    ``loop_minutes``. Unset: the loop has its own ``loop_minutes``."""
    increments: Annotated[int, Field(ge=1)] = 4
    """Stop early once this many trainer increments have been decided by the deployer."""
    until_promoted: bool = False
    """Count only promoted increments towards ``increments`` (the e2e test: run until the loop
    has promoted one by itself, within the time budget)."""
    time_scale: Annotated[float, Field(gt=0.0)] = 0.005
    """Time compression of reward windows and simulated users (1 h -> 18 s at 0.005)."""
    trainer_cadence_s: Annotated[float, Field(gt=0.0)] = 150.0
    """Seconds between scheduled RL increments during the demo (production: 5 h)."""
    simulated_ms_per_token: float = 40.0
    """Simulated generation cost per token added to latency_ms by the gateway (large enough
    that the real, load-dependent generation time on a busy 2-core machine is a small part)."""
    agent: bool = False
    """Agent sessions (``rtrl demo --agent``): users with multi-step tasks that need tools
    (``simulator.agent``), the packaged agent reward spec's session terms, a bootstrap
    champion of middling agents, and the judge's per-session metrics beside the per-request
    ones (docs/demo.md, "Agent sessions"). With ``engine = vllm`` the base model is
    pretrained on the agents' turns and the users work their sessions over chat."""
    engine: Literal["builtin", "vllm"] = "builtin"
    """``builtin``: the built-in token-id policy in the gateway (fast); ``vllm``: a tiny Llama
    built by the demo, served by vLLM's CPU build (``scripts/vllm-env``), chat users, LoRA
    increments loaded into the engine through the canary (docs/demo.md)."""
    model_cache_dir: Path | None = Path("~/.cache/rtrl/demo-models")
    """Where ``--engine vllm`` keeps the base models it built, one per seed and builder version
    (``~`` is the user's home): a second run copies it instead of training it again.
    ``null``: build every time."""
    canary_max_s: Annotated[float, Field(gt=0.0)] | None = None
    """A canary's wall-clock cap before the deployer aborts it as inconclusive (unset: 420 s on
    the built-in policy, 600 s on vLLM, whose latency on a busy 2-core machine is noisier). The
    budget in users from the canary's plan normally ends an undecided canary first."""
    bad_candidate: Literal["reward-hacked", "corrupted", "stalling", "malformed-tool",
                           "none"] = "reward-hacked"
    """The deliberately bad candidate injected once: a policy that asks questions instead
    of editing, or the champion with corrupted weights. Under ``agent`` the default injects
    two, one after the other: an agent that calls tools without their arguments
    (``malformed-tool``) and one that answers every turn with a question (``stalling``);
    name one of them to inject only it."""
    bad_candidate_after_decisions: Annotated[int, Field(ge=0)] = 0
    """Inject the bad candidate once this many canaries have been decided (0: as soon as the
    champion has a baseline, before the first increment is ready)."""
    progress_every_s: Annotated[float, Field(gt=0.0)] = 5.0
    """Seconds between progress lines on the terminal."""
    chaos: bool = False
    """Kill a random service (ingest, reward, trainer, deployer, gateway) with SIGKILL every
    ``chaos_every_s`` and restart it; verify at the end that nothing was lost or duplicated."""
    chaos_every_s: Annotated[float, Field(gt=0.0)] = 90.0
    """Seconds between two kills under ``chaos``."""
    sim_rate_per_s: Annotated[float, Field(ge=0.0)] = 25.0
    """Requests per second of the demo's simulated users (``simulator.rate_per_s``)."""
    load: Annotated[int, Field(ge=0, le=64)] = 0
    """Busy processes started beside the demo, each spinning one core, stopped with it
    (``--load``): a busy machine anyone can reproduce."""
    require_improvement: bool | None = None
    """Promote a canary only when a primary metric is confidently better, not merely no worse
    (``deployer.judge_require_improvement``). Unset: on for ``--engine vllm`` without ``agent``:
    its canaries are small, so its margins are wide (10 points of persistence, 100 ms), and "no
    worse than that" let each promotion give back what the last one gained (seed 6: the first
    champion +11.1% persistence and -12.2% latency against the holdout, the third +1.4% and
    -0.6%; docs/demo.md). Off for the built-in and agent demos, measured without it."""
    sim_users: Annotated[int, Field(ge=1)] | None = None
    """Simulated users in the demo (``simulator.n_users``). Unset: 300, or 1,000 on vLLM
    without ``agent``: the judge counts users, not requests (a user's requests are correlated),
    and with 300 a 50% canary has about 130 users however long it runs, where its plan asked
    for hundreds more; the holdout had 45."""
    seed: int = 0
    """Seeds the demo's simulated world, its users and its bad candidate."""
    holdout_share: Annotated[float, Field(ge=0.0, le=0.5)] = 0.15
    """Share of the simulated users held out on the bootstrap champion for the whole run (the
    long-term holdout, docs/holdout.md): the report measures the last champion against them in
    the same minutes. 0: no holdout."""
    holdout_measure_s: Annotated[float, Field(ge=0.0)] | None = None
    """With a holdout: once the loop has ended (enough canaries decided, or its minutes
    spent), the trainer is stopped and the demo keeps serving this long, so the last champion
    is measured against the holdout for a time fixed before the run (not until it looks good).
    It comes after the loop's own minutes; with a whole-run budget (``minutes``) it ends with
    that budget. Unset: 60 s on the built-in policy, 300 s on vLLM, whose small canaries
    leave a champion a few minutes beside the holdout. 0: none."""
    no_edit_penalty: Annotated[float, Field(ge=0.0)] = 1.0
    """The demo reward spec's ``no_edit`` penalty for a question or an empty completion (0:
    the packaged spec's none; the increments then learn to answer ambiguous tasks with no
    edit, which the edit-rate detector catches). With the demo's latency weight of 2, a
    penalty of 0.5 leaves a question paying more than a rejected edit."""

    def promotes_on_improvement(self) -> bool:
        """``require_improvement``, or the engine's default when it is unset."""
        if self.require_improvement is not None:
            return self.require_improvement
        return self.engine == "vllm" and not self.agent

    def simulated_users(self) -> int:
        """``sim_users``, or the engine's default when it is unset."""
        if self.sim_users is not None:
            return self.sim_users
        return VLLM_SIM_USERS if self.engine == "vllm" and not self.agent else BUILTIN_SIM_USERS

    def holdout_measure_seconds(self) -> float:
        """``holdout_measure_s``, or the engine's default when it is unset."""
        if self.holdout_measure_s is not None:
            return self.holdout_measure_s
        return VLLM_HOLDOUT_MEASURE_S if self.engine == "vllm" else BUILTIN_HOLDOUT_MEASURE_S

    def loop_budget_minutes(self) -> float:
        """``loop_minutes``, or the engine's default when it is unset."""
        if self.loop_minutes is not None:
            return self.loop_minutes
        return VLLM_LOOP_MINUTES if self.engine == "vllm" else BUILTIN_LOOP_MINUTES
