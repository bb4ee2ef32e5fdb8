"""tests/own_warnings.py, the watch .ci/readme_install runs the newest releases under: a deprecation warning with
a frame of grpo_cli/ anywhere on its stack fails, wherever it says it comes from; one without is listed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

from grpo_cli.core import prompt_sharing
from tests.conftest import REPO_ROOT, TINY_LM_CONFIG, build_tiny_lm
from tests.own_warnings import Watch, run_watched
from tests.unit.core.test_prompt_sharing import RenamedCacheKeyword, shared_and_plain_hidden


def old_keyword_shared_forward() -> None:
    """The shared-prompt forward as it was before issue #49 (the cache always by `past_key_values`) on a decoder
    that renamed it: transformers 5.24+'s FutureWarning, reported at torch's module.py."""
    model = build_tiny_lm("LlamaForCausalLM", "LlamaConfig", **TINY_LM_CONFIG)
    original = prompt_sharing.cache_keyword
    prompt_sharing.cache_keyword = lambda module: "past_key_values"
    try:
        shared_and_plain_hidden(RenamedCacheKeyword(model.get_decoder()), model.get_decoder())
    finally:
        prompt_sharing.cache_keyword = original


def test_a_warning_reported_in_torch_is_ours_when_our_call_is_on_its_stack():
    watch = Watch()
    with warnings.catch_warnings(record=True):  # keep them out of this run's own warnings summary
        with watch.active():
            old_keyword_shared_forward()
            warnings.warn("a library's own deprecation", DeprecationWarning, stacklevel=1)  # no grpo_cli/ above
    ours = watch.ours
    # The prompts' pass and the completions' pass, each at its own line of prompt_sharing.py.
    assert len(ours) == 2
    for shown in ours:
        assert shown.category == "FutureWarning" and "Use `cache` instead" in shown.message
        assert shown.location.replace("\\", "/").split("site-packages/")[-1].startswith("torch/nn/modules/module.py")
        assert shown.ours is not None and shown.ours.startswith("grpo_cli/core/prompt_sharing.py:")
        assert shown.ours.endswith("(shared_prompt_response_hidden)")
    (other,) = watch.others
    assert other.category == "DeprecationWarning" and other.ours is None
    assert other.message == "a library's own deprecation"


def test_a_command_under_the_watch_fails_on_ours_and_lists_the_others():
    lines: list[str] = []

    def theirs_only() -> None:
        warnings.warn("a library's own deprecation", FutureWarning, stacklevel=1)
        sys.exit(3)

    with warnings.catch_warnings(record=True):
        assert run_watched(theirs_only, lines.append) == 3  # the command's own status: nothing of ours
        assert lines[0] == "own-warnings: 1 warning(s) no call of ours causes (listed, not failed):"
        assert "no call of ours on its stack" in lines[1] and "a library's own deprecation" in lines[1]
        lines.clear()
        assert run_watched(old_keyword_shared_forward, lines.append) == 1
    failed = [line for line in lines if line.startswith("own-warnings: FAILED: FutureWarning (from our call at ")]
    assert len(failed) == 2 and all("grpo_cli/core/prompt_sharing.py:" in line for line in failed)


def test_the_pytest_plugin_fails_the_test_whose_call_warned_and_lists_the_rest(tmp_path):
    """Through a real pytest run: pytest records every test's warnings in a catch_warnings of its own, which
    resets `warnings.showwarning`; the plugin must watch inside it."""
    (tmp_path / "test_watched.py").write_text(
        textwrap.dedent(
            """
            import warnings

            from grpo_cli.usercode.awaiting import resolved  # torch-free: this run starts in a few seconds

            def library():
                warnings.warn("`old` is deprecated. Use `new` instead.", FutureWarning, stacklevel=2)

            async def user_code():
                library()  # the warning is reported here, in this file, not in one of ours

            def test_ours():
                resolved(user_code())  # our frame, grpo_cli/usercode/awaiting.py, is on the stack

            def test_theirs():
                warnings.warn("a library's own deprecation", DeprecationWarning)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.own_warnings", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "test_watched.py::test_ours" in out
    assert "a warning from our own call: FutureWarning (from our call at grpo_cli/usercode/awaiting.py:" in out
    # Where it was reported: the user's coroutine in that file, not a file of ours.
    assert re.search(r"reported at \S*test_watched\.py:\d+\): `old` is deprecated", out), out
    summary = out.split("own warnings (tests/own_warnings.py)")[-1]
    assert "no call of ours on its stack" in summary and "a library's own deprecation" in summary
