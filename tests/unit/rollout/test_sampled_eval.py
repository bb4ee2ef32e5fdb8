"""n samples per held-out prompt (mean@n, pass@k, maj@n), extra eval sets, the shaping terms (overlong,
repetition) and train.mask_truncated: hand-computed values on tiny inputs (docs/evaluation.md)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from rich.console import Console

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.config import validate_config
from grpo_cli.engines.base import RolloutBatch, SamplingSettings, render_prompts
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.evaluation import evaluate, prefixed, summarize_records, voting_for
from grpo_cli.rollout.rewards import reward_metrics, score_responses
from grpo_cli.rollout.runs import OneTurnRun
from grpo_cli.rollout.sample_metrics import majority_vote, multi_sample_metrics, pass_at_k
from grpo_cli.tasks import get_task, load_eval_sets, make_reward_fn
from grpo_cli.tasks.rewards import SHAPING_CASES, overlong_penalty, repetition_penalty, shaping_case_value
from grpo_cli.tracking.report import extra_eval_keys, write_report
from tests.conftest import FIXTURES, compose_config

# --- pass@k, maj@n ---------------------------------------------------------------------------------------------


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (the first c correct) that hold a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_pass_at_k_equals_brute_force_over_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_special_values_and_bad_input():
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 is the fraction correct
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)  # 1 - C(7,2)/C(10,2)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0..n=4"):
        pass_at_k(4, 5, 1)


def test_majority_vote_groups_math_answers_by_equivalence_not_string_equality():
    voting = voting_for(get_task("math"), "question_only")
    responses = ["\\boxed{2}", "So $\\boxed{0.5}$.", "\\boxed{\\frac{1}{2}}", "The answer is 1/2.", "\\boxed{2}"]
    answers = [voting.answer(r) for r in responses]
    assert answers == ["2", "0.5", "\\frac{1}{2}", "1/2", "2"]
    assert majority_vote(answers) == 0  # string equality: "2" twice beats three different strings
    assert majority_vote(answers, voting.same) == 1  # equivalence: 0.5 = 1/2 = \frac{1}{2}, three votes
    # r1_zero: the tagged answer votes; a broken format has no answer and abstains.
    r1 = voting_for(get_task("math"), "r1_zero")
    assert r1.answer("x </think> <answer>\\boxed{0.5}</answer>") == "0.5" and r1.answer("0.5") is None
    assert majority_vote([None, None]) is None


def test_ties_go_to_the_answer_seen_first_and_keyword_votes_on_normalized_text():
    assert majority_vote(["b", "a", "a", "b"]) == 0
    voting = voting_for(get_task("keyword"), "chat")  # no extracted answer: the whole response votes
    answers = [voting.answer(t) for t in ["A red  apple.", "a red apple.", "A red apple!"]]
    assert answers == ["a red apple.", "a red apple.", "a red apple!"] and majority_vote(answers) == 0


def test_multi_sample_metrics_by_hand():
    correct = [[True, False, False, False], [True, True, True, False]]
    metrics = multi_sample_metrics(correct, votes=[1, None], ks=[1, 2, 4])
    assert metrics == {
        "eval/mean@4": pytest.approx((0.25 + 0.75) / 2),
        "eval/pass@1": pytest.approx((0.25 + 0.75) / 2),
        "eval/pass@2": pytest.approx((0.5 + 1.0) / 2),  # 1 - C(3,2)/C(4,2) = 0.5; c=3 leaves no all-wrong pair
        "eval/pass@4": 1.0,
        "eval/maj@4": 0.0,  # prompt 0's vote is a wrong sample; prompt 1 had no vote
    }


class ListTokenizer:
    """Enough of a tokenizer for evaluate(): text prompts as character codes."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


class ScriptedEngine:
    """Returns, for each prompt, the next n of its scripted completions (prompt-major, as every engine)."""

    def __init__(self, completions: dict[str, list[str]]):
        self.completions = completions

    def generate(self, prompt_ids, settings):
        out = RolloutBatch([], [], [], [])
        for ids in prompt_ids:
            texts = self.completions["".join(map(chr, ids))][: settings.n]
            for text in texts:
                out.prompt_ids.append(ids)
                out.completion_ids.append([ord(c) for c in text])
                out.texts.append(text)
                out.truncated.append(False)
        return out


def test_evaluate_scores_n_samples_and_grades_the_vote():
    from grpo_cli.tasks import Example

    examples = [Example("half?", "\\frac12"), Example("seven?", "7")]
    engine = ScriptedEngine(
        {
            "half?": ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "1/2", "\\boxed{3}"],  # 3 right, and the vote is right
            "seven?": ["\\boxed{2}", "\\boxed{2.0}", "\\boxed{7}", "no idea"],  # 1 right; "2" wins the vote
        }
    )
    cfg = compose_config(["task=math", "task.prompt=question_only"])
    metrics, records = evaluate(
        OneTurnRun(ListTokenizer(), make_reward_fn(cfg.task)),
        engine,
        examples,
        SamplingSettings(n=4, temperature=1.0),
        voting=voting_for(get_task("math"), "question_only"),
        pass_ks=[1, 2, 4],
    )
    assert metrics["eval/reward"] == 0.5 and metrics["eval/mean@4"] == 0.5
    assert metrics["eval/pass@1"] == 0.5 and metrics["eval/pass@2"] == pytest.approx(0.75)
    assert (metrics["eval/pass@4"], metrics["eval/maj@4"]) == (1.0, 0.5)
    assert [r["sample"] for r in records] == [0, 1, 2, 3] * 2
    assert [r["majority"] for r in records] == [True, True, True, False, True, True, False, False]
    assert prefixed({"eval/pass@4": 1.0, "time/eval_s": 2.0}, "gsm8k") == {"eval/gsm8k/pass@4": 1.0, "time/eval_s": 2.0}


def test_a_chunked_eval_samples_what_one_generate_call_samples():
    """32 identical prompts, 4 samples each at temperature 1: two chunks of 64 completions. Each chunk continues
    the random streams where the previous one stopped, so the eval's completions are one generate() call's, and
    the second chunk does not repeat the first."""
    from grpo_cli.models import TINY_RANDOM, load_policy
    from grpo_cli.rollout import HFRolloutEngine
    from grpo_cli.rollout.evaluation import EVAL_CHUNK_PROMPTS
    from grpo_cli.tasks import Example

    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    engine = HFRolloutEngine(model, tokenizer)
    settings = SamplingSettings(n=4, temperature=1.0, max_tokens=4, seed=3)
    examples = [Example("Say something.", "x")] * 32
    assert 32 * 4 > EVAL_CHUNK_PROMPTS  # more than one chunk
    chunks: list[int] = []
    _metrics, records = evaluate(
        OneTurnRun(tokenizer, lambda text, truth: {"reward": 0.0}), engine, examples, settings, chunks.append
    )
    assert chunks == [16, 16]
    prompt_ids = render_prompts([e.prompt for e in examples], tokenizer)
    one_call = engine.generate(prompt_ids, settings)
    responses = [r["response"] for r in records]
    assert responses == one_call.texts
    repeated = sum(a == b for a, b in zip(responses[:64], responses[64:], strict=True))  # today's main: 64
    assert repeated < 8, f"{repeated} of the second chunk's 64 completions repeat the first chunk's"


def test_pass_at_k_reads_the_tasks_own_reward_when_shaping_terms_are_weighted():
    engine = ScriptedEngine({"q": ["red apple apple apple apple", "no"]})
    cfg = compose_config(["task.reward_weights.repetition=1"])
    from grpo_cli.tasks import Example

    run = OneTurnRun(ListTokenizer(), make_reward_fn(cfg.task))
    metrics, records = evaluate(run, engine, [Example("q", ["red", "apple"])], SamplingSettings(n=2))
    # The right answer's reward is 1 - 1/3 (3-grams: red-apple-apple, apple-apple-apple twice: 2 distinct of 3) ...
    assert metrics["eval/reward"] == pytest.approx((1 - 1 / 3 + 0) / 2)
    # ... but it is still a right answer, for pass@k and for job=baseline_eval's accuracy (= mean@n).
    assert (metrics["eval/mean@2"], metrics["eval/pass@2"]) == (0.5, 1.0)
    assert summarize_records(records)["accuracy"] == 0.5


# --- shaping terms --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", SHAPING_CASES, ids=lambda case: f"{case.term}:{case.why}")
def test_shaping_sanity_cases(case):
    assert shaping_case_value(case) == pytest.approx(case.expected, abs=1e-12)


def test_overlong_ramp_and_repetition_by_hand():
    # max 10 tokens, buffer 4: 0 up to 6 tokens, then -1/4 per token down to -1 at 10.
    assert [overlong_penalty(n, 10, 4) for n in (0, 6, 7, 8, 9, 10)] == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(10, 10, 10) == -1.0 and overlong_penalty(1, 10, 10) == -0.1
    with pytest.raises(ValueError):
        overlong_penalty(5, 10, 11)
    # "A pig, black, is a pig, black, a black pig, a black pig": 11 3-grams, 9 distinct.
    assert repetition_penalty("A pig, black, is a pig, black, a black pig, a black pig", 3) == pytest.approx(-2 / 11)
    assert repetition_penalty("pig pig pig pig", 1) == pytest.approx(-3 / 4)
    assert repetition_penalty("", 3) == 0.0


def test_shaping_terms_are_weighted_logged_and_read_the_engines_token_counts():
    cfg = compose_config(
        ["task.reward_weights.overlong=0.5", "task.reward_weights.repetition=2", "rollout.max_tokens=8"]
    )
    validate_config(cfg)  # overlong_buffer null: a quarter of max_tokens = 2 tokens
    reward = make_reward_fn(cfg.task, cfg.rollout.max_tokens)
    responses = ["a red apple", "a red apple a red apple"]
    scores = score_responses(reward, responses, [["red", "apple"]] * 2, n_tokens=[3, 7])
    first, second = scores.rewards
    assert first["reward/overlong"] == 0.0 and first["reward"] == 1.0
    # 7 of 8 tokens: half way through the 2-token buffer; 3-grams: "a red apple" twice and 2 more: 3 distinct of 4.
    assert second["reward/overlong"] == -0.5 and second["reward/repetition"] == pytest.approx(-0.25)
    assert second["reward"] == pytest.approx(1.0 + 0.5 * -0.5 + 2 * -0.25) and second["correctness"] == 1.0
    metrics = reward_metrics(scores, "train")
    assert metrics["train/reward/overlong"] == -0.25 and metrics["train/reward/repetition"] == pytest.approx(-0.125)
    with pytest.raises(ValueError, match="needs the generation limit"):
        make_reward_fn(cfg.task)  # no rollout.max_tokens: the overlong term cannot be computed


# --- configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.n_samples=4"], "set rollout.eval_temperature>0"),
        (["eval.n_samples=0"], "eval.n_samples=0 must be >= 1"),
        (["eval.n_samples=4", "rollout.eval_temperature=1", "eval.pass_k=[1,8]"], "each k must be in 1..eval"),
        (["task.overlong_buffer=64"], "task.overlong_buffer=64 must be between 1 and rollout.max_tokens=48"),
        (["task.repetition_ngram=0"], "task.repetition_ngram=0 must be >= 1"),
        (["+task.eval_sets.reward=x.jsonl"], "task.eval_sets.reward: a set's name prefixes its metrics"),
        (["+task.eval_sets.extra=test"], "task=keyword has no hub dataset"),
        (["task=math", "+task.eval_sets.a=x:y:z:w"], "give a .jsonl file, a split of task.hub_dataset"),
    ],
)
def test_bad_eval_and_shaping_settings_fail_in_one_line(overrides, message):
    with pytest.raises(UserFacingError, match=message) as info:
        validate_config(compose_config(overrides))
    assert "\n" not in str(info.value)


def test_eval_sets_use_the_tasks_loaders_local_files_and_hub_splits():
    cfg = compose_config(
        [
            "task=math",
            f"+task.eval_sets.gsm8k={FIXTURES / 'gsm8k_sample.jsonl'}",
            f"+task.eval_sets.math500={FIXTURES / 'math500_sample.jsonl'}",
            "task.n_eval=2",
        ]
    )
    validate_config(cfg)
    sets = load_eval_sets(cfg.task)
    assert list(sets) == ["gsm8k", "math500"] and all(len(examples) == 2 for examples in sets.values())
    assert sets["gsm8k"][0].ground_truth == "72"  # the math task reads GSM8K lines (#### answer)
    from grpo_cli.tasks import eval_set_config

    hub = eval_set_config(cfg.task, "aime", "HuggingFaceH4/aime_2024:default:train")
    assert (hub.hub_dataset, hub.hub_config, hub.hub_eval_split, hub.eval_path) == (
        "HuggingFaceH4/aime_2024",
        "default",
        "train",
        None,
    )
    assert eval_set_config(cfg.task, "test", "test").hub_dataset == "hiyouga/math12k"


# --- train.mask_truncated -------------------------------------------------------------------------------------


def test_mask_truncated_drops_exactly_the_masked_completions_from_the_gradient(tmp_path):
    from dataclasses import replace

    from grpo_cli.batch.plan import build_update_plan
    from grpo_cli.learner.learner import Learner

    # No gradient clipping (it would rescale both gradients to the same norm and hide their ratio), fp32 (bf16
    # autocast would round the differently grouped rows differently).
    cfg = compose_config(
        ["debug=smoke", "train.mask_truncated=true", "train.max_grad_norm=1e9", "model.mixed_precision=no"],
        output_dir=str(tmp_path),
    )
    learner = Learner(cfg, tmp_path)
    learner.optimizer.step = lambda: None  # keep the weights: only the gradients are compared
    prompts, completions = [[1, 2, 3]] * 4, [[5, 6], [7, 8, 9], [10], [11, 12]]
    rewards, advantages = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.8, -0.3, 0.5, -1.0])

    def gradient(data: RolloutData) -> torch.Tensor:
        # every row one optimizer step, laid out by the learner's plan
        settings = replace(learner.plan_settings(), step_rows=len(data.completion_ids), epochs=1, shuffle=False)
        plan = build_update_plan(data, settings, 1, scores_old=False)
        plan.settle(data, None)
        learner._optimizer_step(data, plan.steps[0], learner.loss.at_step(1), {}, {"time/optimizer_s": 0.0})
        return torch.cat([p.grad.flatten() for p in learner.trainable_parameters]).clone()

    masked = RolloutData(prompts, completions, rewards, advantages, loss_mask=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    kept = [0, 2]
    alone = RolloutData([prompts[i] for i in kept], [completions[i] for i in kept], rewards[kept], advantages[kept])
    # The step's loss is the mean over its completions, and a left-out completion still counts in that mean (it
    # adds 0): a kept one weighs 1/4 among the 4, 1/2 in a batch of the 2 kept ones alone, so the masked batch's
    # gradient is half of theirs (up to float32 sums over differently padded and grouped rows).
    with_mask, without = gradient(masked), gradient(alone)
    assert without.abs().max() > 1e-3  # a real gradient, not two zeros
    torch.testing.assert_close(with_mask, without / 2, rtol=1e-4, atol=1e-5)
    everything_masked = RolloutData(prompts, completions, rewards, advantages, loss_mask=torch.zeros(4))
    assert gradient(everything_masked).abs().max() == 0.0


# --- report ---------------------------------------------------------------------------------------------------


def test_report_shows_pass_and_maj_columns_and_plots(tmp_path):
    rows = [
        {"step": 0, "eval/reward": 0.2, "eval/mean@4": 0.2, "eval/pass@4": 0.5, "eval/pass@1": 0.2, "eval/maj@4": 0.25},
        {"step": 0, "eval/gsm8k/reward": 0.1, "eval/gsm8k/truncated_frac": 0.0, "eval/gsm8k/pass@4": 0.3},
    ]
    merged = [{**rows[0], **rows[1]}]
    assert extra_eval_keys(merged) == [
        "eval/mean@4",
        "eval/pass@1",
        "eval/pass@4",
        "eval/maj@4",
        "eval/gsm8k/reward",
        "eval/gsm8k/pass@4",
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(merged[0]) + "\n")
    (run / "config.yaml").write_text("seed: 0\n")
    report = write_report([str(run)], tmp_path / "report", Console(quiet=True))
    text = (tmp_path / "report" / "report.md").read_text()
    assert "final pass@4" in text and "final maj@4" in text and "final gsm8k pass@4" in text
    assert "eval_pass_at_4.png" in report["plots"] and "eval_gsm8k_reward.png" in report["plots"]
    assert report["runs"][0]["final_eval"]["eval/maj@4"] == 0.25


# --- end to end -----------------------------------------------------------------------------------------------
