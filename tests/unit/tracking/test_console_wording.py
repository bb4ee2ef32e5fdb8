"""The console's counts read as English ("1 step", not "1 steps"), and the long-run hint suggests only settings that
change something (issue 56: `task.n_eval=4` was suggested to a run whose task.n_eval was 4)."""

from grpo_cli.tracking.console import RunClock, counted, long_run_hint, run_size_line


def test_one_of_a_thing_is_singular() -> None:
    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    line = run_size_line(
        steps=1,
        prompts_per_step=1,
        completions_per_step=1,
        max_new_tokens=8,
        eval_rows=1,
        samples_per_eval_row=1,
        eval_at=[1],
    )
    assert line == (
        "size: 1 step x 1 prompt x 1 completion = 1 completion (at most 8 new tokens); "
        "1 evaluation (at step 1) x 1 row = 1 completion (at most 8 new tokens)"
    )


def hint(clock: RunClock, eval_rows: int) -> str:
    text = long_run_hint(
        clock, 1, eval_rows=eval_rows, max_new_tokens=48, on_cpu=True, gpu_experiment=None, task="keyword"
    )
    assert text is not None
    return text


def test_the_long_run_hint_does_not_suggest_the_held_out_size_already_set() -> None:
    clock = RunClock(30, [0, 10, 20, 30])
    clock.eval_done(1200.0)  # evaluations dominate
    clock.step_done(25.0)
    small_set = hint(clock, eval_rows=4)
    assert "task.n_eval" not in small_set and "CPU-sized: train.eval_every=0 (evaluate" in small_set
    assert "task.n_eval=32 train.eval_every=0" in hint(clock, eval_rows=500)
    # Already at the start and the end only, and already small: the steps are what can shrink.
    ends_only = RunClock(30, [0, 30])
    ends_only.eval_done(3000.0)
    ends_only.step_done(25.0)
    text = hint(ends_only, eval_rows=4)
    assert "task.n_eval" not in text and "eval_every" not in text and "CPU-sized: train.steps=" in text
    assert "29 steps at ~25s each and 1 evaluation of 4 rows" in text
