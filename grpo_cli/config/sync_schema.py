"""sync.*: how generation and training interleave (docs/sync.md), its allowed values declared once; re-exported by
grpo_cli.config.schemas, where the other groups' schemas are."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.config.fields import any_value, choice, flag, non_negative, positive

# Sync strategies; the DISAGGREGATED ones run a generator and a learner as Ray actors.
DISAGGREGATED: tuple[str, ...] = ("one_behind", "replay_buffer", "async")
# sync=async: what a sample past the staleness bound meets (docs/sync.md), what the keys/values of a running row's
# tokens become after a weight update lands mid-generation (engines/stream.py), and whose log-probs the ratio
# is clipped against (the proximal policy of decoupled PPO).
ON_STALE: tuple[str, ...] = ("wait", "drop")
KV_AFTER_UPDATE: tuple[str, ...] = ("recompute", "keep")
PROXIMAL_POLICIES: tuple[str, ...] = ("recompute", "behaviour")
SYNC_STRATEGIES: tuple[str, ...] = ("on_policy", "multi_epoch", *DISAGGREGATED)


@dataclass
class SyncConfig:
    """sync.*: how generation and training interleave (docs/sync.md)."""

    strategy: str = choice(
        "on_policy",
        SYNC_STRATEGIES,
        help="How rollouts and updates interleave (docs/sync.md). on_policy: generate a rollout batch, take one "
        "optimizer step on it, repeat (one process) | multi_epoch: several epochs / optimizer steps over each "
        "rollout batch (one process; more than one step per batch needs a ratio loss: grpo_clip, gspo or cispo) | "
        "one_behind: the generator samples batch k+1 while the learner trains on batch k (Ray actors); the "
        "generator is never more than one policy version behind | replay_buffer: the generator keeps filling a "
        "bounded buffer of scored trajectories and each step trains on a uniform sample of it (Ray actors; needs "
        "a ratio loss: grpo_clip, gspo or cispo) | async: the generator never waits for training: it samples up "
        "to sync.max_staleness versions ahead, groups ship as they end, new weights can land mid-generation "
        "(sync.partial_rollouts), every token keeps the version that sampled it and the loss is decoupled PPO "
        "(Ray actors; needs a ratio loss).",
    )
    epochs_per_rollout_batch: int = positive(
        1,
        help="Passes over each rollout batch (each pass takes rollout_batch_size / train_batch_size optimizer steps).",
    )
    old_log_probs: bool | None = flag(
        None,
        help="Compute the old (behaviour) policy's log-probs once per rollout batch. null: when the loss needs "
        "them, i.e. a ratio loss (grpo_clip, gspo, cispo) on an off-policy step (several optimizer steps per "
        "rollout batch, or one_behind / replay_buffer / async) | true: also for other losses (logs "
        "train/old_policy_kl) | false: never (then a ratio loss is only valid on-policy). With one_behind / "
        "replay_buffer the generator computes them with the exact weights that sampled; with async they are the "
        "proximal policy's (sync.proximal).",
    )
    buffer_size: int = positive(
        64,
        help="replay_buffer: trajectories (completions) the buffer holds; the oldest are dropped when it is full. "
        "At least train.rollout_batch_size, the sample each step trains on.",
    )
    max_staleness: int = non_negative(
        2,
        help="The most policy versions a trained sample may lag: learner version - the oldest version that sampled "
        "one of its tokens (versions count learner steps). replay_buffer: older trajectories are dropped unused | "
        "async: the generator starts a group only while that bound can still hold (sync.on_stale=wait) or drops "
        "the groups past it (drop); at least 1 for both.",
    )
    on_stale: str = choice(
        "wait",
        ON_STALE,
        help="async: wait: pace the generator so that no sample can pass sync.max_staleness (each step trains on "
        "its own batch's prompts, in order; the learner waits for a batch's last group) | drop: never pace; each "
        "step trains on the first groups to end and drops (counts: sync/dropped_stale) those past the bound, "
        "which favours short completions.",
    )
    partial_rollouts: bool = flag(
        False,
        help="async: apply a weight update between two decode steps, so running completions continue under the "
        "new weights (each token's version and behaviour log-prob recorded); false: updates wait until the "
        "running completions have ended. Episodes take updates between turns.",
    )
    kv_after_update: str = choice(
        "recompute",
        KV_AFTER_UPDATE,
        help="async with partial_rollouts: recompute: prefill the running rows' tokens again under the new weights "
        "(exact: every token is sampled from the version it records) | keep: keep their keys/values (cheaper; "
        "tokens after the update attend to keys/values of the old weights).",
    )
    proximal: str = choice(
        "recompute",
        PROXIMAL_POLICIES,
        help="async: the policy the ratio is clipped against (decoupled PPO, docs/algorithm.md). recompute: the "
        "learner's log-probs at its own version before the update, weighted by pi_prox / pi_behav | behaviour: "
        "the sampler's own log-probs (the weight is then 1; what one_behind does).",
    )
    behaviour_weight_cap: float | None = positive(
        5.0,
        hint="null: uncapped",
        help="async with sync.proximal=recompute and rollout.importance_correction=none: a token whose off-policy "
        "weight pi_prox / pi_behav exceeds this cap weighs 0 in the loss (it stays in the loss's token counts), as "
        "AReaL's behav_imp_weight_cap masks it; logged as train/behaviour_capped_frac. null: uncapped (refused "
        "with rollout.importance_level=sequence, whose product over a response overflows).",
    )
    generators: int = positive(1, help="async: generator actors, each with its own policy copy and engine.")
    decode_rows: int | None = positive(
        None,
        hint="null: train.rollout_batch_size",
        help="async: the most rows (completions) a generator decodes together; rows of new prompts join as others "
        "end. null: train.rollout_batch_size.",
    )
    simulated_update_s: float | None = non_negative(
        None,
        help="A benchmark arm (docs/sync.md): the learner takes no update and sleeps this many seconds per step "
        "instead (weights unchanged, versions still advance; the step's train/* update metrics are absent), so "
        "that on a machine where generator and learner share the cores the overlap's gain is measured apart from "
        "their competition for them. null: real updates.",
    )
    lockstep: bool = flag(
        False,
        help="async: a fixed schedule for comparisons: each batch is sampled whole by exactly version "
        "step - 1 - max_staleness (no continuous batching, no partial rollouts), as one_behind samples at k=1.",
    )
    ray_address: str | None = any_value(
        None,
        help='one_behind / replay_buffer / async: the Ray cluster to join (its GCS address "127.0.0.1:6379", '
        '"auto" or "ray://head:10001"); null starts a local Ray on this machine for the run and shuts it down '
        "afterwards. On a cluster every node needs grpo-cli installed and must see the run directory and the "
        "task's files at the same paths (checked from each actor), sync.actor_cpus must be set, and "
        "sync.learner_resources / generator_resources place the actors (docs/sync.md).",
    )
    actor_cpus: int | None = positive(
        None,
        hint="null: half this machine's cores; required with sync.ray_address",
        help="CPUs reserved for each actor (generator, learner) and torch threads in it. null: half this machine's "
        "cores (at least 1), so the two actors do not fight over every core; with sync.ray_address it must be set "
        "(this machine's cores say nothing of the cluster's nodes).",
    )
    actor_gpus: float | None = non_negative(
        None, help="GPUs for each actor. null: 1 when this machine has CUDA and model.device is not cpu, else 0."
    )
    learner_resources: dict[str, float] = any_value(
        factory=dict,
        help="Ray custom resources the learner actor asks for, which place it on the nodes that offer them "
        "(`ray start --resources='{\"trainer\": 1}'`), e.g. +sync.learner_resources={trainer: 1}. {}: any node "
        "with its CPUs and GPUs.",
    )
    generator_resources: dict[str, float] = any_value(
        factory=dict,
        help="Ray custom resources each generator actor asks for (as sync.learner_resources), e.g. "
        "+sync.generator_resources={sampler: 1}.",
    )
