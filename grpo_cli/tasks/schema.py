"""The task config schemas every task builds on: TaskConfig (the keys every task has), the reward weights, and
the mixins of the hub-backed and numeric tasks. No torch.

Each task's own schema lives next to its TaskSpec (`KeywordTaskConfig` in tasks/keyword.py, ...) and is named by
`TaskSpec.schema`; grpo_cli/tasks/__init__.py registers them in the config's registry (config/task_registry.py),
and grpo_cli.config registers each as `<name>_schema` in group `task`. To add a task `foo` with a key `foo_size`:
  1. in grpo_cli/tasks/foo.py:  @dataclass class FooTaskConfig(TaskConfig): foo_size: int = positive(3)
     (help="..." on each key), and FOO_TASK = TaskSpec(name="foo", schema=FooTaskConfig, ...) registered in
     grpo_cli/tasks/registry.py's TASKS;
  2. conf/task/foo.yaml starts with   defaults: [foo_schema, _self_]   then `name: foo` and the values that
     differ from the schema's defaults;
  3. python -m grpo_cli.tasks.config_reference > docs/config-reference.md (a test fails while the page lacks the key).
The yaml files of `task` hold only the values of that choice; keys and defaults live in the schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING

from grpo_cli.config.fields import any_value, choice, finite, non_negative, path, positive
from grpo_cli.config.task_registry import task_names
from grpo_cli.sandbox.settings import DEFAULT_LIMITS, DEFAULT_PACKAGES, DEFAULT_UID, ISOLATION_LEVELS

# task.prompt: chat (the tokenizer's chat template), r1_zero (the handout's <think>/<answer> template), question_only.
# Here rather than in tasks/base.py, which imports TaskConfig: the schema is the leaf.
PROMPT_STYLES: tuple[str, ...] = ("chat", "r1_zero", "question_only")
# task.tool_call_format: the names of the tool-call formats grpo-run reads. Declared here, what a task may name;
# each is read and written by its entry of episodes/tool_calls.py's TOOL_CALL_FORMATS (a format added there is
# named here too: tests/unit/episodes/test_tool_calls.py keeps the two in step).
TOOL_CALL_FORMAT_NAMES: tuple[str, ...] = ("hermes",)
# task.on_reward_error: what a reward function or an environment that fails does to the run.
ON_REWARD_ERROR: tuple[str, ...] = ("stop", "skip")


@dataclass
class RewardWeightsConfig:
    """task.reward_weights: one weight per reward component (0: not used). grpo-run task.reward_weights.format=0.1"""

    correctness: float = finite(1.0, help="The task's own reward (r1_zero: format AND correct answer).")
    format: float = finite(0.0, help="The task's format_reward alone (shaping toward the format).")
    answer: float = finite(
        0.0,
        help="The task's answer_reward alone (keyword: fraction of keywords present; json: fraction of right values).",
    )
    numeric_close: float = finite(
        0.0,
        help="gsm8k, regex_sum: 1 when the answer is within task.numeric_tolerance of the truth; medcalc: within an "
        "absolute task.answer_atol.",
    )
    # overlong and repetition: shaping terms every task has, penalties in [-1, 0] (docs/evaluation.md#reward-shaping).
    overlong: float = finite(
        0.0,
        help="DAPO's soft linear penalty (in [-1, 0]) over the last task.overlong_buffer tokens before "
        "rollout.max_tokens (-1 at the limit).",
    )
    repetition: float = finite(
        0.0,
        help="open-r1's n-gram repetition penalty (in [-1, 0]), -(1 - distinct / total word n-grams), "
        "n = task.repetition_ngram.",
    )
    env: float = finite(
        1.0,
        help="Multi-turn episodes with task.environment: the environment's step rewards summed over the episode "
        "(logged as train/reward/env).",
    )


@dataclass
class SandboxConfig:
    """task.sandbox: where model-written code runs (the `python` tool, and user tools through sandbox.run) and
    what one program may use (docs/multi-turn.md#the-python-tools-sandbox). grpo-run task.sandbox.disk_mb=128"""

    isolation: str = choice(
        "bwrap",
        ISOLATION_LEVELS,
        help="bwrap: each program in bubblewrap's user, pid, network, ipc and uts namespaces as uid 1000 without "
        "capabilities, seeing a read-only view of the interpreter and task.sandbox.packages, writing only its own "
        "/tmp; it cannot see, signal or trace the run, reach the network or outlive the call (the run stops in one "
        "line where namespaces cannot be made) | process: a plain subprocess with the limits below, which can read "
        "what the run can read and reach its processes: unsafe for untrusted code.",
    )
    cpu_time_s: int = positive(DEFAULT_LIMITS.cpu_time_s, help="CPU seconds per process of a program (RLIMIT_CPU).")
    wall_time_s: float = positive(
        DEFAULT_LIMITS.wall_time_s, help="Wall-clock seconds per program, its start included; then it is killed."
    )
    memory_mb: int = positive(
        DEFAULT_LIMITS.memory_mb,
        help="Address space per process (RLIMIT_AS); with a memory cgroup (bwrap), also the memory of all its "
        "processes together (plus disk_mb and shm_mb, whose files are memory).",
    )
    max_output_bytes: int = positive(
        DEFAULT_LIMITS.max_output_bytes,
        help="stdout and stderr together; past it the output is cut and the program stopped.",
    )
    max_file_mb: int = positive(
        DEFAULT_LIMITS.max_file_mb, help="Size of any one file a program writes (RLIMIT_FSIZE)."
    )
    disk_mb: int = positive(
        DEFAULT_LIMITS.disk_mb, help="bwrap: the size of the program's /tmp, all its files together (a tmpfs)."
    )
    shm_mb: int = positive(DEFAULT_LIMITS.shm_mb, help="bwrap: the size of the program's own /dev/shm.")
    max_processes: int = positive(
        DEFAULT_LIMITS.max_processes,
        help="bwrap with a pids cgroup: processes and threads of one program together (the log says where no "
        "cgroup can be made).",
    )
    packages: list[str] = any_value(
        factory=lambda: list(DEFAULT_PACKAGES),
        help="bwrap: the installed packages a program may import, bound read-only (with their vendored "
        "libraries); nothing else of site-packages is visible.",
    )
    uid: int = positive(  # and at most MAX_UID: sandbox.require says so in one line (a bound of 2^32 - 2 reads badly)
        DEFAULT_UID,
        hint="an unprivileged uid, not 0 (root)",
        help="When the run is root: the unprivileged host uid (and gid of the same number) programs run as, at "
        "both levels (bwrap maps its uid 1000 to it), after the cgroups are entered as root; the run stops in one "
        "line where it cannot drop to it. 65534: nobody. Unused when the run is not root (programs run as its user).",
    )


@dataclass
class TaskConfig:
    """task.*: the keys every task has."""

    # Dicts of the user's own names, open to new keys on the command line without + (config/registry.py).
    OPEN_KEYS: ClassVar[tuple[str, ...]] = ("tools",)

    name: str = choice(
        MISSING,
        task_names,
        help="The task, set by task=<name> (its registry entry in grpo_cli.tasks.TASKS).",
    )
    prompt: str = choice(
        "chat",
        PROMPT_STYLES,
        help="How a question becomes a prompt. chat: the tokenizer's chat template | r1_zero: the handout's "
        '<think>/<answer> template (generation also stops at "</answer>", kept in the output) | question_only: the '
        "question alone. A task may allow only some of them.",
    )
    train_path: str | None = path(
        None,
        "file",
        help="A local JSONL file of training examples, overriding the task's own data (null: the task's default "
        "source).",
    )
    eval_path: str | None = path(
        None,
        "file",
        help="A local JSONL file of held-out examples, overriding the task's own (null: the task's default source).",
    )
    n_train: int | None = positive(2000, help="How many training examples to build or read (null: all the source has).")
    n_eval: int | None = positive(64, help="How many held-out examples to build or read (null: all the source has).")
    data_seed: int = non_negative(
        1234, help="Seed of the synthetic data generator (independent of the training seed, so the eval set is stable)."
    )
    # Weights of the reward components (RewardWeightsConfig); their weighted sum is the reward advantages use.
    reward_weights: RewardWeightsConfig = field(default_factory=RewardWeightsConfig)
    reward_timeout_s: float = non_negative(
        10.0,
        hint="0: no time limit",
        help="Wall-clock limit per reward call (a TRL-convention call scores a whole batch); a timeout scores 0 and "
        "is counted (train/reward_timeouts). 0: none.",
    )
    eval_sets: dict[str, str] = any_value(
        factory=dict,
        help="Extra held-out sets, each evaluated beside the task's own and logged under eval/<name>/...: a local "
        "JSONL file (*.jsonl), a split of the task's hub dataset, or <dataset>:<split> / "
        "<dataset>:<config>:<split>. grpo-run task=math +task.eval_sets.math500=test "
        "+task.eval_sets.gsm8k=tests/fixtures/gsm8k_sample.jsonl",
    )
    overlong_buffer: int | None = positive(
        None,
        help="reward_weights.overlong: the penalty ramps from 0 to -1 over the last overlong_buffer tokens before "
        "rollout.max_tokens (null: a quarter of rollout.max_tokens).",
    )
    repetition_ngram: int = positive(
        3, help="reward_weights.repetition: the n of the word n-grams whose repeats are penalized."
    )
    on_reward_error: str = choice(
        "stop",
        ON_REWARD_ERROR,
        help="What a reward function (or an environment) that raises, hangs, returns NaN, a string or the wrong "
        "count does to the run: stop (one line naming it; checkpoints kept) or skip (no reward from it for that "
        "sample, counted in train/reward_errors; an environment's episode gets no reward at all and leaves the loss "
        "and its group's advantages, train/skipped_episodes).",
    )
    reward_workers: int = non_negative(
        1,
        hint="0: call the functions in this process, unprotected",
        help="Worker processes that run the user's reward functions (task.rewards), tools and environments, each "
        "call killed at its time limit; calls of several functions, or of per_sample rows, run in parallel across "
        "them. 0: in this process, where a call blocked in C outlives the limit and sys.exit ends the run (the "
        "reward model always runs here).",
    )
    # Multi-turn episodes (docs/multi-turn.md): a task runs them when it names tools or an environment.
    tools: dict[str, Any] = any_value(
        factory=dict,
        help="Tools the model may call in a multi-turn episode, by the name it calls them: "
        "task.tools.calculator=grpo_cli.episodes.builtin_tools:calculator, path/to/file.py:fn, package.module:fn, or a "
        "node {_target_: factory, <arguments>} whose factory returns the function (type hints and a docstring with "
        "Args:).",
    )
    tool_call_format: str | None = choice(
        None,
        TOOL_CALL_FORMAT_NAMES,
        help="How tool calls are written and read (grpo_cli/episodes/tool_calls.py); null: the chat template's own, "
        "else hermes.",
    )
    tool_timeout_s: float = non_negative(
        10.0,
        hint="0: no time limit",
        help="Wall-clock limit per tool call; a call past it is killed and the model reads that it timed out. 0: none.",
    )
    environment: Any = any_value(
        None,
        help="An environment the model talks to in a multi-turn episode, one instance per episode: "
        "path/to/file.py:Class, package.module:Class, or a node {_target_: ..., <constructor arguments>} "
        "(grpo_cli/episodes/environments.py); null: none.",
    )
    environment_factory: Any = any_value(
        None,
        help="TRL's environment_factory: a class with reset(**row) (its string appended to the prompt), its public "
        "methods as the model's tools and an optional get_reward (the env component), one pooled instance per "
        "episode: path/to/file.py:Class, package.module:Class, a node {_target_: ..., <arguments>}, or "
        "{<the row's environment column>: file.py:Class, ...}; rewards may take environments= "
        "(grpo_cli/episodes/adapters/trl.py). Not with task.environment or task.tools; null: none.",
    )
    agent: Any = any_value(
        None,
        help="Agent code that drives each episode itself through an OpenAI client: path/to/file.py:fn, "
        "package.module:fn or a node {_target_: <factory returning it>, <its arguments>} (a verifiers environment: "
        "grpo_cli.endpoint.verifiers_agent.verifiers_agent), called with the keyword arguments it names of row, "
        "prompt, base_url, api_key, model, tokenizer_path, client, async_client; it returns its reward (a number) or "
        "None. The policy is served on a loopback OpenAI-compatible endpoint, and exactly the sampled tokens train "
        "(grpo_cli/usercode/agents.py, docs/multi-turn.md#agents-your-own-code-drives-the-episode). Not with "
        "task.tools, task.environment or task.environment_factory; null: none.",
    )
    agent_timeout_s: float = non_negative(
        600.0,
        hint="0: no time limit",
        help="Wall-clock limit per agent episode (task.agent); an agent past it is that episode's error "
        "(task.on_reward_error). 0: none.",
    )
    max_turns: int = positive(
        4,
        help="Multi-turn episodes: at most this many model turns (an agent's model calls), each at most "
        "rollout.max_tokens tokens.",
    )
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    max_episode_tokens: int | None = positive(
        None,
        help="Multi-turn episodes: at most this many tokens after the prompt, the model's and the tools' or "
        "environment's together (null: only task.max_turns, rollout.max_tokens and the model's context limit an "
        "episode). Whatever it says, an episode ends when the model's context is full (rollout.max_model_len for "
        "rollout.engine=vllm, else the model's max_position_embeddings), counted in train/context_limited.",
    )
    max_observation_tokens: int | None = positive(
        1024,
        help="Multi-turn episodes: a tool result or environment message longer than this many tokens is cut to its "
        "first max_observation_tokens, with a line the model reads saying so (counted in "
        "train/truncated_observations; verl's max_tool_response_length). null: never cut.",
    )

    def reference_dir(self) -> Path:
        """Where relative file references (task.tools, task.environment) and package modules are found: this
        process's working directory (task=custom: its task.base_dir)."""
        return Path.cwd()

    def user_rewards(self) -> Any:
        """task.rewards, the user's reward functions as configured (task=custom); a built-in task has none."""
        return {}


@dataclass
class NumericCloseOptions:
    """The numeric_close reward component's key (a mixin of the task schemas that offer numeric_close)."""

    numeric_tolerance: float = non_negative(
        0.01, help="numeric_close: relative tolerance (0.01: within 1% of the truth)."
    )


@dataclass
class HubTaskConfig(TaskConfig):
    """A task read from a hub dataset through `datasets` when no local path is given."""

    hub_dataset: str | None = any_value(
        None, help="The `datasets` hub id read when task.train_path / task.eval_path is null."
    )
    hub_config: str | None = any_value(None, help="The hub dataset's configuration (subset) name; null: its default.")
    hub_train_split: str = any_value("train", help="The hub dataset's split of training examples.")
    hub_eval_split: str = any_value("test", help="The hub dataset's split of held-out examples.")
