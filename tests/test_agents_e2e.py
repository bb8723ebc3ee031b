"""The real coding agents drive `rewind serve`: Claude Code (`claude -p`, Messages API) and codex
(`codex exec`, Responses API), installed from npm by scripts/install-agents.sh (a failed install
fails these tests), run in a scratch project folder against a `rewind serve` subprocess on
loopback, through a recording proxy.

The model is tiny and random, so the tests check the traffic, not the wisdom: every request the
agent makes is answered 200 in its API's shape, named the served model and carried its tools;
streamed events come in the order the client expects; the agent ends normally (for a model that
never stops on its own within the server's --max-tokens 32, that is the agent's own "output
limit reached" outcome, not a protocol error); and the prompt cache hits.

One run of each agent gets a canned tool call from the proxy as its first answer, so the tool's
result (which the random model would never cause) reaches the server as the agent sends it.

The last tests replay tests/data/agent_traffic.json (recorded from these runs: set
RECORD_AGENT_TRAFFIC=1 to record it again) against an in-process server; they need no npm.

About a minute on 2 cores once the agents are installed; `-s` prints each agent run's time,
requests and time to first token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_checks import (MODEL_NAME, ROOT, anthropic_stream_problems, anthropic_usage,
                          build_agent_model, cached_fraction_anthropic, cached_fraction_responses,
                          canned_anthropic_tool_use, canned_responses_function_call,
                          metric_totals, responses_stream_problems, responses_usage)
from recording_proxy import Exchange, RecordingProxy

from rewind.bench.harness import ServerProcess, free_port

MAX_TOKENS = 32  # the server's output cap: the random model never stops on its own
AGENT_TIMEOUT = 240
FIXTURE = Path(__file__).parent / "data" / "agent_traffic.json"
RECORD = os.environ.get("RECORD_AGENT_TRAFFIC") == "1"

# Keep the agents from phoning home (there is no internet here anyway; in CI there might be).
CLAUDE_QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
                "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
# Headers that say nothing about the client: not recorded.
UNRECORDED_HEADERS = {"host", "content-length", "connection", "accept-encoding"}


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def agents() -> Path:
    """The agents' bin folder, installed once by the script; a failed install fails the test."""
    script = ROOT / "scripts" / "install-agents.sh"
    try:
        done = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True,
                              timeout=1200)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script.name} ran past 20 minutes:\n{exc.stdout}\n{exc.stderr}",
                    pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"{script.name} failed with exit code {done.returncode}:\n{done.stdout}"
                    f"\n{done.stderr}", pytrace=False)
    return ROOT / ".agents" / "node_modules" / ".bin"


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_model(tmp_path_factory.mktemp("agent-model"))


@dataclass
class Served:
    server: ServerProcess
    proxy: RecordingProxy

    def metrics(self) -> dict[str, float]:
        return metric_totals(self.server.base_url)


@pytest.fixture(scope="module")
def served(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`rewind serve` as a subprocess (the real CLI, engine and prompt cache), behind the proxy."""
    scratch = tmp_path_factory.mktemp("agent-server")
    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", str(agent_model),
            "--port", str(port), "--max-tokens", str(MAX_TOKENS), "--cache-dir", str(scratch),
            "--log-level", "warning"]
    server = ServerProcess("rewind", argv, port, scratch / "server.log",
                           ready_paths=("/health",)).start()
    try:
        server.wait_ready(timeout=300)
        with RecordingProxy(server.base_url) as proxy:
            yield Served(server, proxy)
    finally:
        server.stop()


@dataclass
class AgentRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    exchanges: list[Exchange] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"$ {' '.join(self.argv)}  -> exit {self.returncode} in {self.seconds:.1f} s"]
        for e in self.exchanges:
            lines.append(f"  {e.method} {e.path} -> {e.status} in {e.seconds:.1f} s "
                         f"{e.error or ''}{e.response_body[:300]!r}")
        return "\n".join(lines + ["stdout: " + self.stdout[-2000:],
                                  "stderr: " + self.stderr[-2000:]])


def run_agent(argv: list[str], env: dict[str, str], cwd: Path, served: Served) -> AgentRun:
    served.proxy.take()
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
            "TERM": "dumb", "NO_COLOR": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(argv, check=False, cwd=cwd, env={**base, **env}, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=AGENT_TIMEOUT)
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = -1
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    run = AgentRun(argv, returncode, stdout, stderr, time.monotonic() - start)
    run.exchanges = served.proxy.take()
    # Shown with -s: what the README's figures come from.
    timings = ", ".join(f"{e.seconds:.1f} s (first token {e.first_token_seconds() or 0:.1f} s)"
                        for e in run.exchanges)
    print(f"\n{Path(argv[0]).name}: {run.seconds:.1f} s, {len(run.exchanges)} requests: "
          f"{timings}", file=sys.stderr)
    return run


def project_folder(root: Path) -> Path:
    """A scratch project with a few files for the agents to look at."""
    project = root / "project"
    (project / "src").mkdir(parents=True, exist_ok=True)
    (project / "README.md").write_text("# demo\n\nA tiny project for the agent tests.\n")
    (project / "src" / "app.py").write_text("def main() -> None:\n    print('hello')\n")
    return project


def claude_env(served: Served, home: Path) -> dict[str, str]:
    return {"HOME": str(home), **CLAUDE_QUIET,
            "ANTHROPIC_BASE_URL": served.proxy.url, "ANTHROPIC_API_KEY": "sk-rewind-test",
            # Its small/fast model (titles, summaries, ...) and the model families' defaults:
            # every request must name the model served.
            "ANTHROPIC_MODEL": MODEL_NAME, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL_NAME,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL_NAME,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL_NAME,
            "CLAUDE_CODE_SUBAGENT_MODEL": MODEL_NAME}


def codex_home(served: Served, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(f"""\
model = "{MODEL_NAME}"
model_provider = "rewind"
model_context_window = 131072
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.rewind]
name = "Rewind"
base_url = "{served.proxy.url}/v1"
wire_api = "responses"
""")
    return folder


# ---- what every agent request must show ---------------------------------------------------------

def check_anthropic_traffic(run: AgentRun) -> list[dict]:
    """Every request 200, in order, naming the served model, with tools; returns each request's
    message_start usage."""
    assert run.exchanges, run.describe()
    usages = []
    for e in run.exchanges:
        assert e.error is None and e.status == 200, run.describe()
        assert e.method == "POST" and e.path.split("?")[0] == "/v1/messages", run.describe()
        body = e.json()
        assert body["model"] == MODEL_NAME, body["model"]
        assert body["stream"] is True
        names = {tool.get("name") for tool in body.get("tools") or []}
        assert {"Bash", "Read"} <= names, names
        assert e.streamed, e.response_headers
        events = e.sse_events()
        assert not anthropic_stream_problems(events), (anthropic_stream_problems(events),
                                                       run.describe())
        start, end = anthropic_usage(events)
        # Anthropic reports the input and cache figures up front; the end repeats them.
        assert start["input_tokens"] == end["input_tokens"], (start, end)
        assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"], (start, end)
        assert 1 <= end["output_tokens"] <= MAX_TOKENS
        usages.append(start)
    return usages


def check_claude_result(run: AgentRun) -> dict:
    """The agent's own verdict: a result, never an HTTP or protocol error. With a model that
    does not stop within the server's cap, Claude Code retries ("Output token limit hit. Resume
    directly") and then ends with api_error "max_output_tokens": its ordinary outcome here."""
    result = json.loads(run.stdout)
    assert result["type"] == "result", run.describe()
    assert result.get("api_error_status") is None, run.describe()
    if run.returncode == 0 and not result["is_error"]:
        return result
    assert run.returncode == 1 and result["api_error"] == "max_output_tokens", run.describe()
    return result


def prompt_key(body: dict) -> str:
    """What a request's prompt depends on (not its session ids or output limit)."""
    return json.dumps([body.get("system"), body.get("messages"), body.get("tools"),
                       body.get("instructions"), body.get("input")], sort_keys=True)


# ---- Claude Code --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def claude_runs(agents: Path, served: Served, tmp_path_factory) -> list[AgentRun]:
    """Two `claude -p` runs in the same project folder, one after the other."""
    root = tmp_path_factory.mktemp("claude")
    project, home = project_folder(root), root / "home"
    home.mkdir()
    argv = [str(agents / "claude"), "-p", "list the files", "--output-format", "json",
            "--model", MODEL_NAME]
    runs = [run_agent(argv, claude_env(served, home), project, served) for _ in range(2)]
    if RECORD:
        record("claude_code", [runs[0].exchanges[0], runs[1].exchanges[0],
                               *runs[0].exchanges[1:2]],
               {str(project): "/home/user/project", str(home): "/home/user",
                # Claude Code's folder of the project's memory is named after its path.
                str(project).replace("/", "-"): "-home-user-project",
                served.proxy.url: "http://127.0.0.1:1234"})
    return runs


def test_claude_code_requests_succeed_in_order(claude_runs, served):
    for run in claude_runs:
        check_anthropic_traffic(run)
        check_claude_result(run)
    metrics = served.metrics()
    assert metrics.get("rewind_http_errors_total", 0) == 0, metrics
    made = sum(len(run.exchanges) for run in claude_runs)
    assert metrics["rewind_requests_total"] >= made, (metrics, made)


def test_claude_code_second_run_hits_the_cache(claude_runs):
    """The second run in the same folder sends the first run's prompts again (in a new session):
    each one it repeats is read from the cache for >= 90% of its tokens, in message_start."""
    first, second = claude_runs
    seen = {prompt_key(e.json()) for e in first.exchanges}
    usages = check_anthropic_traffic(second)
    assert cached_fraction_anthropic(usages[0]) >= 0.9, usages[0]
    for exchange, usage in zip(second.exchanges, usages):
        if prompt_key(exchange.json()) in seen:
            assert cached_fraction_anthropic(usage) >= 0.9, usage
        else:  # a turn the first run did not take: at least its system prompt and tools
            assert cached_fraction_anthropic(usage) >= 0.5, usage


def test_claude_code_retries_in_a_session_hit_the_cache(claude_runs):
    """Issue 14: from the second request of a session on, >= 90% of the prompt is cached."""
    first = claude_runs[0]
    usages = check_anthropic_traffic(first)
    assert usages[0]["cache_read_input_tokens"] == 0
    # The retries that rewrote the first user message (the answer before was thinking only).
    opening = len(first.exchanges[0].json()["messages"])
    fractions = [round(cached_fraction_anthropic(usage), 3)
                 for exchange, usage in zip(first.exchanges[1:], usages[1:])
                 if len(exchange.json()["messages"]) == opening]
    if not fractions:
        pytest.skip("no retry of that kind in this run (the model stopped or left thinking)")
    assert min(fractions) >= 0.9, fractions


@pytest.fixture(scope="module")
def claude_tool_run(agents: Path, served: Served, tmp_path_factory) -> AgentRun:
    """A `claude -p` run whose first answer is a canned tool call (Read README.md) from the proxy;
    Claude Code runs the tool and the rest of the session goes to the server."""
    root = tmp_path_factory.mktemp("claude-tool")
    project, home = project_folder(root), root / "home"
    home.mkdir()
    calls = []

    def answer(exchange: Exchange) -> bytes | None:
        if calls:
            return None
        calls.append(exchange)
        return canned_anthropic_tool_use("Read", {"file_path": str(project / "README.md")},
                                         MODEL_NAME)

    served.proxy.answer = answer
    try:
        run = run_agent([str(agents / "claude"), "-p", "list the files", "--output-format",
                         "json", "--model", MODEL_NAME], claude_env(served, home), project,
                        served)
    finally:
        served.proxy.answer = None
    if RECORD:
        record("claude_code_tool_result", run.exchanges[1:2],
               {str(project): "/home/user/project", str(home): "/home/user",
                str(project).replace("/", "-"): "-home-user-project",
                served.proxy.url: "http://127.0.0.1:1234"})
    return run


def test_claude_code_tool_round_trip(claude_tool_run):
    """The tool call's result goes to the server in the next request, is accepted, and the
    requests after it (Claude Code's retries: reminders appended to the tool result's message)
    read >= 90% of their prompt from the cache."""
    run = claude_tool_run
    assert run.exchanges and run.exchanges[0].canned, run.describe()
    served_part = AgentRun(run.argv, run.returncode, run.stdout, run.stderr, run.seconds,
                           run.exchanges[1:])
    usages = check_anthropic_traffic(served_part)
    check_claude_result(run)
    messages = run.exchanges[1].json()["messages"]
    assert [m["role"] for m in messages] == ["user", "system", "assistant", "user"], messages
    call = messages[2]["content"][0]
    assert call["type"] == "tool_use" and call["id"] == "toolu_canned_0001", call
    result = messages[3]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == call["id"], result
    assert "A tiny project for the agent tests" in json.dumps(result["content"]), result
    fractions = [round(cached_fraction_anthropic(usage), 3) for usage in usages[1:]]
    assert all(fraction >= 0.9 for fraction in fractions), fractions


# ---- codex --------------------------------------------------------------------------------------

def check_responses_traffic(run: AgentRun) -> list[dict]:
    assert run.exchanges, run.describe()
    usages = []
    for e in run.exchanges:
        assert e.error is None and e.status == 200, run.describe()
        assert e.method == "POST" and e.path == "/v1/responses", run.describe()
        body = e.json()
        assert body["model"] == MODEL_NAME and body["stream"] is True
        names = {tool.get("name") or tool.get("type") for tool in body.get("tools") or []}
        assert "exec_command" in names or "shell" in names, names
        events = e.sse_events()
        assert not responses_stream_problems(events), (responses_stream_problems(events),
                                                       run.describe())
        usage = responses_usage(events)
        assert 1 <= usage["output_tokens"] <= MAX_TOKENS, usage
        usages.append(usage)
    return usages


def check_codex_result(run: AgentRun) -> None:
    """`codex exec --json` events: the turn ends, completed or failed for the output cap (codex
    reports a response the server cut at --max-tokens as "Incomplete response returned,
    reason: max_output_tokens"), never for an HTTP or stream error."""
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kinds = [event.get("type") for event in events]
    assert "turn.completed" in kinds or "turn.failed" in kinds, run.describe()
    for event in events:
        if event.get("type") == "turn.failed":
            assert "max_output_tokens" in event["error"]["message"], run.describe()
    assert run.returncode in (0, 1), run.describe()


@pytest.fixture(scope="module")
def codex_runs(agents: Path, served: Served, tmp_path_factory) -> list[AgentRun]:
    """`codex exec`, then `codex exec resume --last`: two turns of one session."""
    root = tmp_path_factory.mktemp("codex")
    project, home = project_folder(root), root / "home"
    config = codex_home(served, root / "codex-home")
    env = {"HOME": str(home), "CODEX_HOME": str(config)}
    common = ["--skip-git-repo-check", "--sandbox", "read-only", "--json", "--strict-config"]
    codex = str(agents / "codex")
    runs = [run_agent([codex, "exec", *common, "list the files"], env, project, served),
            run_agent([codex, "exec", *common, "resume", "--last", "and the folders?"], env,
                      project, served)]
    if RECORD:
        record("codex", [runs[0].exchanges[0], runs[1].exchanges[0]],
               {str(project): "/home/user/project", str(config): "/home/user/.codex",
                str(home): "/home/user", served.proxy.url: "http://127.0.0.1:1234"})
    return runs


def test_codex_requests_succeed_in_order(codex_runs, served):
    for run in codex_runs:
        check_responses_traffic(run)
        check_codex_result(run)
    first = codex_runs[0].exchanges[0].json()
    assert first.get("max_output_tokens") is None  # codex sends no limit: the server's cap ends it
    assert served.metrics().get("rewind_http_errors_total", 0) == 0


def test_codex_second_turn_hits_the_cache(codex_runs, served):
    first, second = (check_responses_traffic(run)[0] for run in codex_runs)
    assert cached_fraction_responses(first) < 0.5, first  # nothing of codex's was cached yet
    assert cached_fraction_responses(second) >= 0.9, second
    cached = served.metrics().get("rewind_cached_prompt_tokens_total", 0)
    assert cached >= second["input_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def codex_tool_run(agents: Path, served: Served, tmp_path_factory) -> AgentRun:
    """A `codex exec` turn whose first answer is a canned `exec_command` of `ls`."""
    root = tmp_path_factory.mktemp("codex-tool")
    project, home = project_folder(root), root / "home"
    config = codex_home(served, root / "codex-home")
    calls = []

    def answer(exchange: Exchange) -> bytes | None:
        if calls:
            return None
        calls.append(exchange)
        return canned_responses_function_call("exec_command", {"cmd": "ls"}, MODEL_NAME)

    served.proxy.answer = answer
    try:
        run = run_agent([str(agents / "codex"), "exec", "--skip-git-repo-check", "--sandbox",
                         "read-only", "--json", "list the files"],
                        {"HOME": str(home), "CODEX_HOME": str(config)}, project, served)
    finally:
        served.proxy.answer = None
    if RECORD:
        record("codex_tool_output", run.exchanges[1:2],
               {str(project): "/home/user/project", str(config): "/home/user/.codex",
                str(home): "/home/user", served.proxy.url: "http://127.0.0.1:1234"})
    return run


def test_codex_tool_round_trip(codex_tool_run):
    """codex runs the canned `ls` in its sandbox and sends the output to the server, which takes
    the function call and its output as part of the conversation."""
    run = codex_tool_run
    assert len(run.exchanges) >= 2 and run.exchanges[0].canned, run.describe()
    check_responses_traffic(AgentRun(run.argv, run.returncode, run.stdout, run.stderr,
                                     run.seconds, run.exchanges[1:]))
    check_codex_result(run)
    items = run.exchanges[1].json()["input"]
    call = next(item for item in items if item.get("type") == "function_call")
    output = next(item for item in items if item.get("type") == "function_call_output")
    assert call["call_id"] == output["call_id"] == "call_canned_0001", items[-2:]
    assert "README.md" in output["output"], output


# ---- the recorded traffic, replayed -------------------------------------------------------------

def record(agent: str, exchanges: list[Exchange], paths: dict[str, str]) -> None:
    """Write `agent`'s requests into the fixture, with this machine's paths replaced."""

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            for real, neutral in sorted(paths.items(), key=lambda kv: -len(kv[0])):
                value = value.replace(real, neutral)
            return value
        if isinstance(value, list):
            return [scrub(item) for item in value]
        if isinstance(value, dict):
            return {key: scrub(item) for key, item in value.items()}
        return value

    requests = [scrub({"method": e.method, "path": e.path,
                       "headers": {k: v for k, v in sorted(e.request_headers.items())
                                   if k not in UNRECORDED_HEADERS},
                       "body": e.json()}) for e in exchanges]
    text = json.dumps(requests)
    for leftover in ("/tmp/", "-tmp-", str(ROOT), str(Path.home()) + "/"):
        assert leftover not in text, f"{leftover} left in the recorded traffic"
    fixture = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    fixture[agent] = requests
    FIXTURE.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")


def fixture_requests(agent: str) -> list[dict]:
    return json.loads(FIXTURE.read_text())[agent]


@pytest.fixture(scope="module")
def replay_server(agent_model: Path, tmp_path_factory) -> Iterator[Any]:
    """A fresh in-process server (real engine and prompt cache) for the recorded requests."""
    from live_server import tiny_live_server

    with tiny_live_server(agent_model, tmp_path_factory.mktemp("replay"),
                          max_tokens=MAX_TOKENS) as live:
        yield live


def replay(live: Any, request: dict, body: dict | None = None) -> Exchange:
    """Send a recorded request as the agent sent it (headers, path, body) and read its stream."""
    content = json.dumps(request["body"] if body is None else body).encode()
    exchange = Exchange(request["method"], request["path"], request["headers"], content,
                        time.monotonic())
    with httpx.stream(request["method"], live.url + request["path"], content=content,
                      headers=request["headers"], timeout=120) as response:
        exchange.status = response.status_code
        exchange.response_headers = dict(response.headers)
        exchange.response_body = response.read()
    exchange.seconds = time.monotonic() - exchange.started
    assert exchange.status == 200, exchange.response_body[:500]
    return exchange


def test_fixture_holds_what_the_agents_send():
    """What each agent sends beyond the basics, as recorded: the replays below carry all of it."""
    claude = fixture_requests("claude_code")
    first = claude[0]
    assert first["headers"]["user-agent"].startswith("claude-cli/2.1.332")
    assert "anthropic-beta" in first["headers"] and "x-claude-code-session-id" in first["headers"]
    body = first["body"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header: cc_version=")
    assert any(block.get("cache_control") for block in body["system"])
    assert [m["role"] for m in body["messages"]] == ["user", "system"]  # the environment block
    assert body["thinking"]["type"] == "adaptive" and body["output_config"]["effort"]
    assert body["metadata"]["user_id"] and body["context_management"]["edits"]
    assert body["max_tokens"] == 32000 and claude[2]["body"]["max_tokens"] == 128000
    assert len(body["tools"]) >= 10
    codex = fixture_requests("codex")
    assert codex[0]["headers"]["user-agent"].startswith("codex_exec/0.171.0")
    body = codex[0]["body"]
    assert "max_output_tokens" not in body and body["prompt_cache_key"]
    assert body["store"] is False and body["reasoning"] == {"summary": "auto"}
    assert [item.get("role") for item in body["input"]] == ["developer", "developer", "user",
                                                            "user"]
    assert {"function", "web_search"} <= {tool["type"] for tool in body["tools"]}


def test_replayed_claude_code_traffic_succeeds_and_hits_the_cache(replay_server):
    """Run 1's first request, run 2's first request (a new session, the same prompt), then run 1's
    retry after max_tokens."""
    requests = fixture_requests("claude_code")
    usages = []
    for request in requests:
        exchange = replay(replay_server, request)
        events = exchange.sse_events()
        assert not anthropic_stream_problems(events), anthropic_stream_problems(events)
        start, end = anthropic_usage(events)
        assert (start["input_tokens"], start["cache_read_input_tokens"]) == \
            (end["input_tokens"], end["cache_read_input_tokens"])
        usages.append(start)
    assert usages[0]["cache_read_input_tokens"] == 0
    assert cached_fraction_anthropic(usages[1]) >= 0.9, usages[1]
    assert cached_fraction_anthropic(usages[2]) >= 0.9, usages[2]


def test_replayed_claude_code_tools_reach_the_prompt(replay_server):
    """The server's own count of the recorded request, with and without its tools."""
    body = {k: v for k, v in fixture_requests("claude_code")[0]["body"].items()
            if k not in ("stream", "max_tokens")}
    counted = []
    for fields in (body, {k: v for k, v in body.items() if k != "tools"}):
        answer = httpx.post(replay_server.url + "/v1/messages/count_tokens", json=fields,
                            timeout=60)
        assert answer.status_code == 200, answer.text
        counted.append(answer.json()["input_tokens"])
    tool_tokens = len(replay_server.loaded.tokenizer.encode(json.dumps(body["tools"])))
    assert counted[0] - counted[1] >= 0.5 * tool_tokens, (counted, tool_tokens)


def test_replayed_interactive_claude_code_hits_despite_its_billing_header(replay_server):
    """Interactive Claude Code adds `cch=...` to its billing-header block, new on every request;
    the server drops the block, so the next request still reads its prefix from the cache."""
    request = fixture_requests("claude_code")[0]
    usages = []
    for cch in ("3f9a1", "b07c2"):
        body = json.loads(json.dumps(request["body"]))
        body["system"][0]["text"] = body["system"][0]["text"].rstrip() + f" cch={cch};"
        # A conversation of its own, so the first of the two is not already cached.
        body["messages"][0]["content"][-1]["text"] = "list the files, interactively"
        usages.append(anthropic_usage(replay(replay_server, request, body).sse_events())[0])
    assert cached_fraction_anthropic(usages[1]) >= 0.9, usages


def test_replayed_codex_traffic_succeeds_and_hits_the_cache(replay_server):
    """Turn 1 of a codex session, then turn 2 (`codex exec resume`), then turn 1 without its
    tools: the tools make up their share of the prompt."""
    turn1, turn2 = fixture_requests("codex")
    usages = []
    for request in (turn1, turn2):
        events = replay(replay_server, request).sse_events()
        assert not responses_stream_problems(events), responses_stream_problems(events)
        usages.append(responses_usage(events))
    assert cached_fraction_responses(usages[0]) < 0.5, usages[0]
    assert cached_fraction_responses(usages[1]) >= 0.9, usages[1]
    toolless = {k: v for k, v in turn1["body"].items() if k not in ("tools", "tool_choice")}
    bare = responses_usage(replay(replay_server, turn1, toolless).sse_events())
    tools = [tool for tool in turn1["body"]["tools"] if tool["type"] == "function"]
    tool_tokens = len(replay_server.loaded.tokenizer.encode(json.dumps(tools)))
    assert usages[0]["input_tokens"] - bare["input_tokens"] >= 0.5 * tool_tokens, \
        (usages[0], bare, tool_tokens)
    assert metric_totals(replay_server.url).get("rewind_http_errors_total", 0) == 0


def test_replayed_tool_turns_succeed(replay_server):
    """Claude Code's request carrying a tool_use and its tool_result (after run 1's first
    request, whose prompt it extends: >= 90% cached), and codex's carrying a function_call and
    its output."""
    first = fixture_requests("claude_code")[0]
    replay(replay_server, first)
    request = fixture_requests("claude_code_tool_result")[0]
    assert [m["role"] for m in request["body"]["messages"]] == ["user", "system", "assistant",
                                                                "user"]
    events = replay(replay_server, request).sse_events()
    assert not anthropic_stream_problems(events), anthropic_stream_problems(events)
    assert cached_fraction_anthropic(anthropic_usage(events)[0]) >= 0.9
    request = fixture_requests("codex_tool_output")[0]
    kinds = [item.get("type") for item in request["body"]["input"]]
    assert kinds[-2:] == ["function_call", "function_call_output"], kinds
    events = replay(replay_server, request).sse_events()
    assert not responses_stream_problems(events), responses_stream_problems(events)
