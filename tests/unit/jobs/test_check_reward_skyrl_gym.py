"""skyrl-gym 0.4.0's own test cases for its shipped environments (gsm8k, gsm8k_multi_turn, text2sql, search), run
through `job=check_reward` against the installed, unchanged environments (the SkyRL adapter of
episodes/environments.py), and compared with SkyRL's own scoring of the same scripted turns: the environment driven as
SkyRL's generator drives it (`skyrl_generator_score`). The actions and expected rewards are those of skyrl-gym
0.4.0's sdist, tests/test_gsm8k.py, tests/test_sql.py (on a real SQLite database built here) and tests/test_search.py
(against a retrieval server on loopback started here); gsm8k_multi_turn has no test there, so its rows are shaped as
SkyRL's own dataset script (examples/train/turn_level_rewards/gsm8k_multi_turn_dataset.py) makes them.
Results: docs/results/2026-11-28-skyrl-gym.md.
"""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import skyrl_gym
from omegaconf import DictConfig
from rich.console import Console

from grpo_cli.jobs.check_reward import run as check_reward
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from tests.conftest import compose_config

ADAPTER = "grpo_cli.episodes.environments.SkyRLGymEnvironment"


def skyrl_generator_score(env_class: str, env_config: dict[str, Any], row: dict[str, Any], turns: list[str],
                          max_turns: int) -> tuple[float, list[list[dict[str, str]]]]:  # fmt: skip
    """SkyRL's scoring of scripted turns, written from its generator (SkyRLGymGenerator.agent_loop,
    skyrl/train/generators/skyrl_gym_generator.py at NovaSky-AI/SkyRL b8a5caaab81d75190b55d22c8774f5cc9d5f1f54): the
    row's columns but prompt and env_class as extras, extras["max_turns"] = generator.max_turns, env_config a
    DictConfig, init(prompt), step(text) per turn until done; the trajectory's score is the sum of its per-step
    rewards (the token-level rewards it places at each turn's end). Independent of the adapter under test."""
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
    extras["max_turns"] = max_turns
    env = skyrl_gym.make(env_class, env_config=DictConfig(env_config), extras=extras)
    env.init(row["prompt"])
    total, observations = 0.0, []
    for turn in turns[:max_turns]:
        out = env.step(turn)
        total += out["reward"]
        observations.append(out["observations"])
        if out["done"]:
            break
    env.close()
    return total, observations


def run_cases(tmp_path: Path, env: str, env_config: dict[str, Any], cases: list[dict[str, Any]],
              max_turns: int) -> tuple[dict[str, Any], str]:  # fmt: skip
    """`grpo-run job=check_reward task=custom` on the cases, the environment the SkyRL adapter over `env`."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    row = {k: v for k, v in cases[0].items() if k not in ("turns", "expected", "why")}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", cases_path="cases.jsonl", prompt="chat",
        environment={"_target_": ADAPTER, "env": env, "env_config": env_config}, max_turns=max_turns,
    )  # fmt: skip
    absolutize_paths(task, tmp_path)
    cfg = compose_config(["job=check_reward", "task=custom", f"task.base_dir={tmp_path}"])
    cfg.task = task
    out = Console(file=io.StringIO(), width=400, highlight=False)
    result = check_reward(cfg, tmp_path, out)
    return result, out.file.getvalue()


def prompt(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------------- gsm8k (tests/test_gsm8k.py)

GSM8K_CASES = [  # test_compute_score's (output, ground_truth, expected)
    ("The answer is #### 42", "42", 1.0),
    ("The answer is #### 42", "43", 0.0),
    ("The answer is 42", "42", 0.0),  # answer is not in the expected format
]


def test_skyrl_gyms_gsm8k_cases_pass_check_reward(tmp_path: Path) -> None:
    cases = []
    for output, truth, expected in GSM8K_CASES:
        row = {"prompt": prompt("What is 6 times 7?"), "reward_spec": {"method": "rule", "ground_truth": truth}}
        assert skyrl_generator_score("gsm8k", {}, row, [output], 1)[0] == expected  # the peer's own number
        cases.append({**row, "turns": [output], "expected": {"env": expected}})
    result, text = run_cases(tmp_path, "gsm8k", {}, cases, max_turns=1)
    assert result == {"n": 3, "n_disagree": 0}, text
    assert text.count("ended: done") == 3


# ----------------------------------------------------------------------- gsm8k_multi_turn (SkyRL's dataset rows)


def gsm8k_multi_turn_row(max_turns_in_row: int) -> dict[str, Any]:
    return {
        "data_source": "openai/gsm8k",
        "prompt": prompt('What is 6 times 7? Let\'s think step by step and output a tentative answer after "####".'),
        "env_class": "gsm8k_multi_turn",
        "reward_spec": {"method": "rule", "ground_truth": "42"},
        "extra_info": {"max_turns": max_turns_in_row, "split": "train", "index": 0},
    }  # fmt: skip


def test_gsm8k_multi_turn_gets_task_max_turns_as_skyrl_does(tmp_path: Path) -> None:
    # The case: three well-formed wrong answers, task.max_turns=3 against a row that says 5. SkyRL's
    # generator writes generator.max_turns into the extras, so the environment's format score is 0.2/3 per turn:
    # 0.2 in all. Keeping the row's 5 scores 3 x 0.2/5 = 0.12, and never shows the last-turn prompt.
    row = gsm8k_multi_turn_row(max_turns_in_row=5)
    wrong = ["6 times 7 is 41.\n#### 41", "Let me check: #### 41", "#### 41"]
    peer, observations = skyrl_generator_score("gsm8k_multi_turn", {}, row, wrong, max_turns=3)
    assert peer == pytest.approx(0.2)  # the number the issue quotes for SkyRL
    last_turn_prompt = observations[1][0]["content"]
    assert last_turn_prompt.startswith("Now provide only the final numeric answer")
    without_max_turns = dict(row)
    kept_row_limit = sum(skyrl_gym.make("gsm8k_multi_turn", extras=without_max_turns).step(t)["reward"] for t in wrong)
    assert kept_row_limit == pytest.approx(0.12)  # what the adapter gave before it passed task.max_turns

    right_late = ["#### 41", "#### 42"]
    peer_right, _ = skyrl_generator_score("gsm8k_multi_turn", {}, row, right_late, max_turns=3)
    cases = [
        {**row, "turns": wrong, "expected": {"env": peer}, "why": "three well-formed wrong answers"},
        {**row, "turns": right_late, "expected": {"env": peer_right}, "why": "wrong, then right: done"},
        {**row, "turns": ["I do not know."] * 3, "expected": {"env": 0.0}, "why": "no '#### N' at all"},
    ]
    result, text = run_cases(tmp_path, "gsm8k", {}, cases, max_turns=3)  # the row's env_class picks the class
    assert result == {"n": 3, "n_disagree": 0}, text
    assert f"user: {last_turn_prompt}" in text  # the last-turn prompt, shown after the 2nd of 3 turns


# ------------------------------------------------------------------------------------ text2sql (tests/test_sql.py)

SQL_1 = "SELECT name FROM employees WHERE id = 1;"
SQL_2 = "SELECT name FROM employees WHERE id = 2;"
# test_compute_score's cases: (step 1, step 2, ground truth, expected). Their test mocks sqlite3 ("GOLDEN_SQL;"
# returns John Doe); here a real database with the two rows the mock returns, and for "golden_sql_same_result" a
# different gold query with the same result, which is that case's point.
SQL_CASES = [
    ("<think>a</think>\n\n         <sql>" + SQL_1 + "</sql>", "<think>b</think>\n\n         <solution>" + SQL_1
     + "</solution>", SQL_1, 1.0, "correct_sql_and_solution"),
    ("<think>a</think>\n\n         <sql>" + SQL_1 + "</sql>", "<think>b</think>\n\n         <solution>" + SQL_1
     + "</solution>", "SELECT name FROM employees WHERE name = 'John Doe';", 1.0, "golden_sql_same_result"),
    ("<think>a</think>\n\n         <sql>" + SQL_1 + "</sql>", "<think>b</think>\n\n         <solution>" + SQL_2
     + "</solution>", SQL_1, 0.0, "wrong_solution"),
    ("<think>a</think>", "<think>b</think>\n\n         <solution>" + SQL_1 + "</solution>", SQL_1, 1.0,
     "invalid_sql_msg"),
]  # fmt: skip


def spider_db(root: Path) -> Path:
    """The least text2sql reads: env_config.db_path/spider/database/<db_id>/<db_id>.sqlite, with the rows
    skyrl-gym's test mocks (id 1 John Doe, id 2 Jane Smith)."""
    folder = root / "spider" / "database" / "test_db"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "test_db.sqlite") as db:
        db.execute("CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT)")
        db.executemany("INSERT INTO employees VALUES (?, ?)", [(1, "John Doe"), (2, "Jane Smith")])
    return root


def test_skyrl_gyms_text2sql_cases_pass_check_reward(tmp_path: Path) -> None:
    env_config = {"db_path": str(spider_db(tmp_path / "sql_data"))}  # read as env_config.db_path: a DictConfig
    cases = []
    for step_1, step_2, truth, expected, why in SQL_CASES:
        row = {"prompt": prompt("Who is employee 1?"), "reward_spec": {"method": "rule", "ground_truth": truth},
               "db_id": "test_db", "data": "spider"}  # fmt: skip
        peer, observations = skyrl_generator_score("text2sql", env_config, row, [step_1, step_2], max_turns=3)
        assert peer == expected, why  # the peer's own number, on the real database
        # their test's checks of the first observation: the reminder counts task.max_turns down
        assert "<reminder>You have 2 turns left to complete the task.</reminder>" in observations[0][0]["content"]
        cases.append({**row, "turns": [step_1, step_2], "expected": {"env": expected}, "why": why})
    result, text = run_cases(tmp_path, "text2sql", env_config, cases, max_turns=3)
    assert result == {"n": 4, "n_disagree": 0}, text
    assert "You have 2 turns left to complete the task." in text and "John Doe" in text
    assert "Your previous action is invalid." in text  # the 4th case's first turn has no <sql>


# ------------------------------------------------------------ search (tests/test_search.py), a local retriever

# The documents skyrl-gym's test mocks its search API with, served by a retriever on loopback instead: search's
# call_search_api POSTs {"query", "topk", "return_scores"} to env_config.search_url as SkyRL's retrieval server
# takes them. (Their timeout and server-error cases exercise the client's retries, not a reward: not played here.)
SEARCH_DOCUMENTS = {
    "Who is the president of France?": {"result": [[
        {"document": {"contents": "Emmanuel Macron is the current President of France, serving since 2017."}},
        {"document": {"contents": "France is a republic with a president as head of state."}},
    ]]},
    "What is the capital of Italy?": {"result": [[
        {"document": {"contents": "Rome is the capital and largest city of Italy."}},
    ]]},
    "Invalid query": {"result": []},
}  # fmt: skip


@pytest.fixture
def retriever():
    """A retrieval server on a random loopback port answering SEARCH_DOCUMENTS (else no results): its URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Retrieve(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            query = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"]
            body = json.dumps(SEARCH_DOCUMENTS.get(query, {"result": []})).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Retrieve)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


MACRON = {"target": "Emmanuel Macron"}
FRANCE = "<search>Who is the president of France?</search>"
SEARCH_CASES = [  # (turns, ground truth, expected reward, the test of theirs it comes from), max_turns 3
    ([FRANCE, "<answer>Emmanuel Macron</answer>"], MACRON, 1.0, "test_successful_search_and_answer"),
    ([FRANCE, "<answer>Nicolas Sarkozy</answer>"], MACRON, 0.0, "test_search_then_wrong_answer"),
    (["<search>Invalid query</search>"], MACRON, 0.0, "test_search_with_no_results"),
    (["<answer>Emmanuel Macron</answer>"], MACRON, 1.0, "test_reward_computation"),
    (["<answer>Nicolas Sarkozy</answer>"], MACRON, 0.0, "test_reward_computation"),
    (["<search>Who is the president?</search>"], MACRON, 0.0, "test_reward_computation"),
    (["<answer>  Emmanuel Macron  </answer>"], MACRON, 1.0, "test_reward_computation"),
    (["<answer>emmanuel macron</answer>"], MACRON, 1.0, "test_reward_computation"),
    (["<answer>Emmanuel Macron</answer>"], {"target": "The Emmanuel Macron"}, 1.0, "test_reward_computation"),
    (["Just text without answer tag"], MACRON, 0.0, "test_reward_computation"),
]


def search_cases(cases: list[tuple[list[str], dict[str, str], float, str]], env_config: dict[str, Any],
                 max_turns: int) -> list[dict[str, Any]]:  # fmt: skip
    out = []
    for turns, truth, expected, why in cases:
        row = {"prompt": prompt("Who is the president of France?"),
               "reward_spec": {"method": "rule", "ground_truth": truth}}  # fmt: skip
        peer, _ = skyrl_generator_score("search", env_config, row, turns, max_turns)
        assert peer == expected, why  # the peer's own number, against the local retriever
        out.append({**row, "turns": turns, "expected": {"env": expected}, "why": why})
    return out


def test_skyrl_gyms_search_cases_pass_check_reward_with_a_local_retriever(tmp_path: Path, retriever: str) -> None:
    env_config = {"log_requests": False, "search_url": retriever, "topk": 3, "timeout": 30}
    result, text = run_cases(tmp_path / "three", "search", env_config, search_cases(SEARCH_CASES, env_config, 3), 3)
    assert result == {"n": len(SEARCH_CASES), "n_disagree": 0}, text
    assert "Doc 1: Emmanuel Macron is the current President of France" in text and "No search results found" in text
    # test_max_turns_reached: max_turns 2, two searches: the environment ends the episode itself, no reward
    two = search_cases(
        [([FRANCE, "<search>More info about France?</search>"], MACRON, 0.0, "max turns")], env_config, 2
    )
    result, text = run_cases(tmp_path / "two", "search", env_config, two, 2)
    assert result == {"n": 1, "n_disagree": 0} and "ended: done" in text, text
