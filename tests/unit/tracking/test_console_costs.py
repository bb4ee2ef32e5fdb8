"""What a run costs, said before it is paid: the size line, the time left on the step line, the long-run hint."""

import pytest

from grpo_cli.tracking.console import (
    LONG_RUN_S,
    RunClock,
    evaluation_steps,
    format_duration,
    long_run_hint,
    run_size_line,
)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (44.6, "45s"), (60, "1m00s"), (725, "12m05s"), (3599, "59m59s"), (11400, "3h10m")]
)
def test_durations_read_as_a_progress_bar_writes_them(seconds, text):
    assert format_duration(seconds) == text


def test_evaluations_come_at_step_0_every_eval_every_steps_and_at_the_end():
    assert evaluation_steps(30, 10) == [0, 10, 20, 30]
    assert evaluation_steps(25, 10) == [0, 10, 20, 25]
    assert evaluation_steps(30, 0) == [0, 30]  # eval_every=0: the start and the end only
    assert evaluation_steps(30, 10, start_step=12) == [20, 30]  # a resumed run has no step-0 evaluation


def test_the_size_line_multiplies_out_steps_prompts_tokens_and_evaluation_rows():
    line = run_size_line(
        steps=30,
        prompts_per_step=4,
        completions_per_step=16,
        max_new_tokens=48,
        eval_rows=64,
        samples_per_eval_row=1,
        eval_at=[0, 10, 20, 30],
    )
    # 30 x 16 = 480 completions, x 48 = 23,040 tokens; 4 evaluations x 64 rows = 256, x 48 = 12,288 tokens
    assert line == (
        "size: 30 steps x 4 prompts x 4 completions = 480 completions (at most 23,040 new tokens); "
        "4 evaluations (at steps 0, 10, 20, 30) x 64 rows = 256 completions (at most 12,288 new tokens)"
    )
    sampled = run_size_line(
        steps=2,
        prompts_per_step=2,
        completions_per_step=4,
        max_new_tokens=8,
        eval_rows=500,
        samples_per_eval_row=4,
        eval_at=list(range(0, 101, 10)),
    )
    # 11 evaluations x 500 rows x 4 samples = 22,000 completions; the list of steps is cut short
    assert "11 evaluations (at steps 0, 10, ..., 100) x 500 rows x 4 samples = 22,000 completions" in sampled


def test_the_time_left_counts_the_steps_and_the_evaluations_still_to_come():
    clock = RunClock(30, [0, 10, 20, 30])
    assert clock.eta_text(1) == ""  # nothing measured yet: no guess
    clock.eval_done(100.0)  # the step-0 evaluation
    clock.step_done(20.0)
    clock.step_done(30.0)
    # after step 2: 28 steps x 25 s (the mean) + 3 evaluations (10, 20, 30) x 100 s = 1000 s
    assert clock.remaining_s(2) == 28 * 25.0 + 3 * 100.0
    assert clock.eta_text(2) == "eta 16m40s"
    # after step 10 its own evaluation is still to run: 20 x 25 + 3 x 100
    assert clock.remaining_s(10) == 20 * 25.0 + 3 * 100.0
    assert clock.remaining_s(30) == 100.0  # the last step: only the final evaluation is left


def test_a_resumed_run_says_its_evaluations_are_not_yet_timed():
    clock = RunClock(30, [20, 30])
    clock.step_done(10.0)
    assert clock.remaining_s(13) is None
    assert clock.eta_text(13) == "eta 2m50s + evaluations"  # 17 steps x 10 s


def test_a_long_run_names_a_cpu_sized_and_a_gpu_sized_alternative():
    clock = RunClock(30, [0, 10, 20, 30])
    clock.eval_done(1200.0)  # a large held-out set dominates: 3 x 20 min left
    clock.step_done(25.0)
    hint = long_run_hint(
        clock, 1, eval_rows=500, max_new_tokens=1024, on_cpu=True, gpu_experiment="cs336_math", task="math"
    )
    assert hint is not None
    assert hint.startswith(f"this run needs about {format_duration(29 * 25 + 3 * 1200)} more here")
    assert "3 evaluations of 500 rows" in hint and "task.n_eval=32 train.eval_every=0" in hint
    assert "GPU-sized: experiment=cs336_math on a GPU" in hint
    on_gpu = long_run_hint(
        clock, 1, eval_rows=500, max_new_tokens=1024, on_cpu=False, gpu_experiment="cs336_math", task="math"
    )
    assert on_gpu is not None and "experiment=" not in on_gpu and "task.n_eval=" in on_gpu


def test_where_the_steps_dominate_the_hint_shortens_the_steps_and_a_short_run_gets_none():
    clock = RunClock(300, [0, 300])
    clock.eval_done(10.0)
    clock.step_done(60.0)  # 299 steps x 60 s >> 1 evaluation x 10 s
    hint = long_run_hint(clock, 1, eval_rows=64, max_new_tokens=48, on_cpu=True, gpu_experiment=None, task="keyword")
    # as many steps as fit in 80% of LONG_RUN_S at 60 s each: 1440 / 60 = 24; 48 tokens are already few
    assert hint is not None and "CPU-sized: train.steps=24, or debug=smoke" in hint
    assert "task=keyword as it is, on a GPU" in hint
    longer = long_run_hint(clock, 1, eval_rows=64, max_new_tokens=1024, on_cpu=True, gpu_experiment=None, task="x")
    assert longer is not None and "train.steps=24 rollout.max_tokens=256," in longer
    short = RunClock(3, [0, 3])
    short.eval_done(1.0)
    short.step_done(1.0)
    assert short.remaining_s(1) < LONG_RUN_S
    assert long_run_hint(short, 1, eval_rows=4, max_new_tokens=8, on_cpu=True, gpu_experiment=None, task="k") is None
