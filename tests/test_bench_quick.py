"""The side-by-side bench: its text generator, its process harness, its reports, and one --quick
run end to end against a real `rewind serve` on a tiny model. No timing is asserted here: speed
lives in benchmarks/results/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.bench.client import make_client, timed_chat
from rewind.bench.harness import RssSampler, ServerProcess, ServerStartError, free_port
from rewind.bench.report import Plot, Report, Table, fmt_spread, spread
from rewind.bench.servers import ModelFiles, ServerOptions, build_server, has_half_weights
from rewind.bench.textgen import CHARS_PER_TOKEN, AgenticText, agent_messages

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- text ---------------------------------------------------------------------------------------
def test_text_is_deterministic_per_seed_and_differs_across_seeds() -> None:
    first, again, other = AgenticText(3), AgenticText(3), AgenticText(4)
    assert first.system_prompt(500) == again.system_prompt(500)
    assert first.turn() == again.turn()
    assert AgenticText(3).system_prompt(500) != other.system_prompt(500)


def test_text_sizes_follow_the_token_targets() -> None:
    text = AgenticText(1)
    system = text.system_prompt(2000)
    tool = text.tool_result(400)
    assert 2000 * CHARS_PER_TOKEN <= len(system) < 2600 * CHARS_PER_TOKEN
    assert 400 * CHARS_PER_TOKEN <= len(tool) < 500 * CHARS_PER_TOKEN
    assert '"name":"' in system  # tool definitions are in the system prompt


def test_agent_messages_drop_reasoning_and_alternate_roles() -> None:
    text = AgenticText(2)
    turns = [text.turn(answer_tokens=40, tool_tokens=50) for _ in range(3)]
    messages = agent_messages("system text", "the task", turns)
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user"] + ["assistant", "user"] * 3
    joined = "\n".join(m["content"] for m in messages)
    for turn in turns:
        assert turn.answer in joined and turn.tool_result in joined
        assert turn.reasoning not in joined


# --- process harness ----------------------------------------------------------------------------
def test_server_process_waits_samples_rss_and_stops(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess("http.server", [sys.executable, "-m", "http.server", str(port),
                                           "--bind", "127.0.0.1"],
                           port, tmp_path / "http.log", ready_paths=("/",), model_id="x")
    server.start()
    sampler = RssSampler(server.pid, interval=0.05).start()
    try:
        server.wait_ready(timeout=30)
        assert sampler.mark("ready") > 1 << 20  # a Python process holds megabytes
    finally:
        sampler.stop()
        server.stop()
    assert server.process is not None and server.process.poll() is not None
    assert sampler.samples and sampler.peak() >= sampler.marks["ready"][1]


def test_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    server = ServerProcess("broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                           free_port(), tmp_path / "broken.log")
    server.start()
    with pytest.raises(ServerStartError, match="no model here"):
        server.wait_ready(timeout=30)


# --- reports ------------------------------------------------------------------------------------
def test_spread_and_its_formatting() -> None:
    stats = spread([3.0, 1.0, 2.0, None])
    assert stats == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert fmt_spread(stats, 1, " s") == "2.0 s (1.0-3.0)"
    assert fmt_spread(spread([])) == "n/a"


def test_report_writes_json_markdown_and_png(tmp_path: Path) -> None:
    report = Report(workload="demo", command="rewind bench demo", params={"k": 1},
                    servers={"a": "server a"}, fairness=["same weights"],
                    records=[{"server": "a", "ttft_s": 0.5}],
                    tables=[Table("Title", ["server", "ttft"], [["a", "0.50"]])],
                    plots=[Plot("plot.png", "t", "x", "y", {"a": ([1, 2], [0.5, 0.4])})])
    paths = report.write(tmp_path, "demo")
    assert {p.name for p in paths} == {"demo.json", "demo.md", "demo-plot.png"}
    payload = json.loads((tmp_path / "demo.json").read_text())
    assert payload["records"] == [{"server": "a", "ttft_s": 0.5}]
    assert payload["machine"]["cores"] >= 1
    markdown = (tmp_path / "demo.md").read_text()
    assert "| a | 0.50 |" in markdown and "![demo-plot.png](demo-plot.png)" in markdown
    assert (tmp_path / "demo-plot.png").read_bytes()[:4] == b"\x89PNG"


# --- real servers on a tiny model ---------------------------------------------------------------
def test_mlx_lm_baseline_answers_a_timed_chat(tiny_model_path, tmp_path: Path) -> None:
    folder = tiny_model_path("gemma3")
    assert not has_half_weights(folder)  # so no float32 copy is made for the tiny model
    model = ModelFiles(name="tiny", mlx_folder=folder, gguf=None)
    server = build_server("mlx-lm", model, ServerOptions(parallel=2), free_port(), tmp_path)
    with server.start():
        server.wait_ready(timeout=120)
        timing = timed_chat(make_client(server.base_url),
                            [{"role": "user", "content": "hello there"}], max_tokens=4,
                            model=server.model_id or "default")
    assert timing.completion_tokens == 4 and timing.prompt_tokens and timing.prompt_tokens > 2
    assert 0 < timing.ttft_s <= timing.e2e_s


def test_agentic_quick_runs_and_reports(tmp_path: Path) -> None:
    """What CI runs: `rewind bench agentic --quick` against rewind serve on a tiny model."""
    done = subprocess.run(
        [sys.executable, "-m", "rewind", "bench", "agentic", "--quick", "--servers", "rewind",
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "agentic-quick.json").read_text())
    idle = [r for r in payload["records"] if r.get("idle")]
    records = [r for r in payload["records"] if not r.get("idle")]
    assert {r["server"] for r in records} == {"rewind"}
    assert len(records) == payload["params"]["sessions"] * payload["params"]["turns"]
    # One stream alone before the sessions: the idle decode step the gaps are read against.
    assert len(idle) == 1 and idle[0]["token_gaps_s"]
    assert all(r["after_first_s"] >= 0 for r in records)
    # Every turn resends a longer prompt than the one before it, in each session.
    for session in range(payload["params"]["sessions"]):
        sizes = [r["prompt_tokens"] for r in sorted(records, key=lambda r: r["turn"])
                 if r["session"] == session]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    # Rewind reports cached tokens, and later turns reuse the earlier prompt.
    assert all(r["cached_tokens"] is not None for r in records)
    assert any(r["cached_tokens"] > 0 for r in records if r["turn"] > 0)
    markdown = (tmp_path / "agentic-quick.md").read_text()
    assert "| rewind |" in markdown
    assert "Streaming after the first token" in markdown
    assert (tmp_path / "agentic-quick-ttft.png").exists()
    # Start-up: /health, then the first answer (which may come later: mlx-lm loads after /health).
    run = next(iter(payload["summary"]["runs"].values()))
    assert 0 < run["ready_s"] <= run["first_answer_s"]
    assert "### Start-up" in markdown and "until the first answer" in markdown


def test_edits_quick_runs_both_rewinds_and_reports_the_same_answers(tmp_path: Path) -> None:
    """`rewind bench edits --quick`: real files of the installed mlx-lm asked back, on rewind
    (speculating) and rewind-nospec; every greedy answer is the same on both, and the
    speculating one reports its drafts in usage."""
    done = subprocess.run(
        [sys.executable, "-m", "rewind", "bench", "edits", "--quick", "--servers",
         "rewind,rewind-nospec", "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "edits-quick.json").read_text())
    records = payload["records"]
    params = payload["params"]
    per_server = len(params["files"][1:3]) * (1 + params["sessions"])
    assert sum(r["server"] == "rewind" for r in records) == per_server
    assert sum(r["server"] == "rewind-nospec" for r in records) == per_server
    assert all(r["accepted"] is None for r in records if r["server"] == "rewind-nospec")
    markdown = (tmp_path / "edits-quick.md").read_text()
    assert f"| rewind | alone | {per_server // (1 + params['sessions'])} / 2 |" in markdown
    assert "vs rewind-nospec" in markdown


def test_rewind_arg_reaches_every_rewind_server_of_a_workload(tmp_path: Path) -> None:
    """`--rewind-arg` (any side-by-side workload) is passed to each `rewind serve` it starts, and
    the report's server commands show it."""
    done = subprocess.run(
        [sys.executable, "-m", "rewind", "bench", "parallel-chat", "--quick", "--servers",
         "rewind", "--max-tokens", "4", "--rewind-arg=--mixed-prefill-tokens=9",
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    markdown = next(tmp_path.glob("parallel-chat*.md")).read_text()
    commands = [line for line in markdown.splitlines()
                if line.startswith("- **rewind@p") and "`rewind serve --model" in line]
    assert len(commands) == 2, markdown  # --parallel 4 and 1
    assert all("--mixed-prefill-tokens=9" in line for line in commands), commands
