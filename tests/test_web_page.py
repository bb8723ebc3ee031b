"""The web page at / in a real browser: Debian's Chromium, headless, driven through Selenium and
Debian's chromedriver (nothing is downloaded at run time), against a real server on loopback with
tiny random models. Any error in the browser's console fails the test (a Content-Security-Policy
violation is one). A screenshot of each view is saved: under $REWIND_TEST_ARTIFACTS when set
(CI uploads it), else in the test's temporary folder.

Skipped, saying why, where Chromium, chromedriver or the selenium package is missing
(`bash scripts/setup.sh` installs them as root on Debian)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import tiny_live_server
from pool_server import pool_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no Chromium and chromedriver on PATH (Debian: apt-get install chromium "
                "chromium-driver; scripts/setup.sh does it as root)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver",
                                reason="the selenium package is missing (pip install -e .[dev])")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

pytestmark = pytest.mark.slow
WAIT_SECONDS = 60


@pytest.fixture(autouse=True)
def own_catalog(tmp_path, monkeypatch):
    """Only the test's models in the pool's catalog: no real default, no real hub cache."""
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture
def artifacts(tmp_path) -> Path:
    folder = Path(os.environ.get("REWIND_TEST_ARTIFACTS") or tmp_path / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser(tmp_path) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,1000", f"--user-data-dir={tmp_path / 'profile'}",
                 "--no-first-run", "--disable-extensions"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Not the test process's LD_PRELOAD (scripts/test.sh preloads OpenBLAS for MLX): Chromium's
    # renderers die with it.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER,
                                                              env=env),
                              options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait_for(condition: Callable[[], Any], what: str, seconds: float = WAIT_SECONDS) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception:  # noqa: BLE001 - an element being replaced as the page re-renders
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def assistant_answers(driver: Any) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def cached_of(answer: Any) -> tuple[int, int]:
    """(prompt tokens, cached tokens) in an answer's usage line."""
    text = answer.find_element(By.CSS_SELECTOR, ".usage").text.replace(",", "")
    match = re.search(r"prompt (\d+) tokens (\d+) cached", text)
    assert match, text
    return int(match.group(1)), int(match.group(2))


def send_and_wait(driver: Any, text: str) -> Any:
    before = len(assistant_answers(driver))
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    return finished_answer(driver, before + 1)


def finished_answer(driver: Any, number: int) -> Any:
    """The `number`th answer, once its stream has ended (its usage line is shown)."""
    def done() -> Any:
        answers = assistant_answers(driver)
        if len(answers) < number or driver.find_element(By.ID, "send").get_attribute("disabled"):
            return None
        answer = answers[number - 1]
        return answer if answer.find_elements(By.CSS_SELECTOR, ".usage") else None
    return wait_for(done, f"answer {number}")


def answer_text(answer: Any) -> str:
    content = answer.find_element(By.CSS_SELECTOR, ".content").text
    reasoning = answer.find_elements(By.CSS_SELECTOR, ".reasoning pre")
    return content + "".join(r.get_attribute("textContent") for r in reasoning)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def table_rows(driver: Any, selector: str) -> list[list[str]]:
    """The cells' text of each row, read in one go: the sessions view re-renders as it polls."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map("
        "row => [...row.cells].map(cell => cell.textContent))", selector)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_chat_models_and_sessions_in_a_real_browser(tiny_model_path, tmp_path, browser,
                                                    artifacts):
    names = [str(tiny_model_path("llama")), str(tiny_model_path("gemma3"))]
    with pool_server(names, tmp_path / "pool") as (live, _):
        browser.get(f"{live.url}/")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#model-select option"),
                 "the model picker")
        assert browser.find_element(By.ID, "model-select").get_attribute("value") == names[0]
        for field, value in (("max-tokens", "12"), ("temperature", "0")):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)

        # Chat: a streamed answer, then a follow-up that reuses the first turn's prefix.
        first = send_and_wait(browser, "Name three colours of the rainbow.")
        assert answer_text(first)
        usages = [cached_of(first)]
        second = send_and_wait(browser, "And two more, please?")
        prompt, cached = cached_of(second)
        assert 0 < cached < prompt

        # Edit and resend the last question: everything before it comes from the cache.
        browser.find_elements(By.CSS_SELECTOR, "#messages .message.user .edit")[-1].click()
        edit = wait_for(lambda: browser.find_element(By.CSS_SELECTOR, ".edit-box"), "the editor")
        edit.clear()
        edit.send_keys("And two more colours, please?")
        browser.find_element(By.XPATH, "//button[text()='Send edited']").click()
        edited = finished_answer(browser, 2)
        prompt, cached = cached_of(edited)
        assert 0 < cached < prompt
        browser.find_element(By.CSS_SELECTOR, ".message.assistant .regenerate").click()
        usages.append(cached_of(finished_answer(browser, 2)))
        browser.save_screenshot(str(artifacts / "chat.png"))

        # Sessions: one conversation of four turns; its tokens match /metrics.
        browser.find_element(By.ID, "tab-sessions").click()
        wait_for(lambda: [row[2] for row in table_rows(browser, "#sessions-table tr.session")]
                 == ["4"], "one session of four turns")
        [row] = table_rows(browser, "#sessions-table tr.session")
        prompt_total, ram, disk, recomputed = (number(row[i]) for i in (3, 4, 5, 6))
        assert prompt_total == metric(live.url, "rewind_prompt_tokens_total")
        assert ram == metric(live.url, 'rewind_cached_prompt_tokens_total{tier="ram"}')
        assert disk == metric(live.url, 'rewind_cached_prompt_tokens_total{tier="disk"}')
        assert recomputed == prompt_total - ram - disk
        turns = table_rows(browser, "#turns-table tbody tr")
        assert len(turns) == 4
        for turn, (prompt, cached) in zip((turns[0], turns[3]), usages):
            assert number(turn[2]) == prompt and number(turn[3]) + number(turn[4]) == cached
        assert browser.find_elements(By.CSS_SELECTOR, "#turns-chart svg rect.tokens")
        # The timeline: a thumbnail per session, and in the detail one tick per checkpoint
        # the server recorded for each turn, no higher than that turn's bar.
        [session] = httpx.get(f"{live.url}/v1/rewind/sessions", timeout=30).json()["data"]
        checkpoints = [len(turn["checkpoints"]) for turn in session["turns"]]
        assert all(checkpoints)
        assert browser.find_elements(
            By.CSS_SELECTOR, "#sessions-table tr.session td.timeline-cell svg.compact rect.tokens")
        assert browser.execute_script(
            "return document.querySelectorAll('#turns-chart svg line.checkpoint').length"
        ) == sum(checkpoints)
        assert browser.execute_script(
            "const top = Math.min(...[...document.querySelectorAll('#turns-chart rect.tokens')]"
            ".map(r => +r.getAttribute('y')));"
            "return [...document.querySelectorAll('#turns-chart line.checkpoint')]"
            ".every(l => +l.getAttribute('y1') >= top - 1e-6)")
        assert browser.find_elements(By.CSS_SELECTOR, "#memory-chart svg rect")
        assert "hit rate" in browser.find_element(By.ID, "card-cache").text
        browser.save_screenshot(str(artifacts / "sessions.png"))

        # Models: load the second model, then unload it.
        browser.find_element(By.ID, "tab-models").click()
        selector = f'#models-table tr[data-model="{names[1]}"]'

        def state() -> str:
            return browser.find_element(By.CSS_SELECTOR, f"{selector} td.state").text

        wait_for(lambda: state() == "unloaded", "the second model listed as unloaded")
        browser.find_element(By.CSS_SELECTOR, f"{selector} button.load").click()
        wait_for(lambda: state() == "loaded", "the second model loaded")
        browser.save_screenshot(str(artifacts / "models.png"))
        browser.find_element(By.CSS_SELECTOR, f"{selector} button.unload").click()
        wait_for(lambda: state() == "unloaded", "the second model unloaded")
        assert console_errors(browser) == []


def test_the_page_asks_for_the_key_and_keeps_it_in_session_storage(tiny_model_path, tmp_path,
                                                                    browser):
    with tiny_live_server(tiny_model_path("llama"), tmp_path, api_key="sk-web-test") as live:
        browser.get(f"{live.url}/")
        form = wait_for(lambda: browser.find_element(By.ID, "key-form").is_displayed()
                        and browser.find_element(By.ID, "key-form"), "the key form")
        assert "sk-web-test" not in browser.page_source
        browser.find_element(By.ID, "key-input").send_keys("sk-web-test")
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#model-select option"),
                 "the model picker, with the key")
        assert browser.execute_script(
            "return sessionStorage.getItem('rewind-api-key')") == "sk-web-test"
        assert browser.execute_script("return localStorage.length") == 0
        box = browser.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys("6")
        assert answer_text(send_and_wait(browser, "Hello there."))
        assert console_errors(browser) == []


def test_pull_a_model_from_the_models_view(tiny_model_path, tmp_path, browser, artifacts):
    """The Models view's pull form against `rewind serve` and a hub on loopback: the progress
    bar fills from the stream, the pulled model is listed, and a missing repo says so."""
    from fake_hub import fake_hub
    from serve_subprocess import rewind_serve

    repo = "tiny-org/tiny-gemma3"
    with fake_hub(chunk_delay=0.002) as (hub_url, hub):
        hub.add(repo, tiny_model_path("gemma3"))
        with rewind_serve(tiny_model_path("llama"), tmp_path, hub_url) as url:
            browser.get(f"{url}/#models")
            wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#models-table tr[data-model]"),
                     "the models list")
            assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-model="{repo}"]')
            browser.find_element(By.ID, "pull-repo").send_keys(repo)
            browser.find_element(By.ID, "pull-button").click()
            status = wait_for(lambda: "is pulled" in browser.find_element(By.ID, "pull-status").text
                              and browser.find_element(By.ID, "pull-status").text, "the pull")
            assert status.startswith(f"{repo} is pulled: f32")
            bar = browser.find_element(By.ID, "pull-progress")
            assert float(bar.get_attribute("value")) == float(bar.get_attribute("max")) > 1
            row = wait_for(lambda: browser.find_element(By.CSS_SELECTOR,
                                                        f'#models-table tr[data-model="{repo}"]'),
                           "the pulled model listed")
            assert row.find_element(By.CSS_SELECTOR, "td.state").text == "unloaded"
            assert browser.find_elements(By.CSS_SELECTOR, f'#model-select option[value="{repo}"]')
            browser.save_screenshot(str(artifacts / "models-pull.png"))

            browser.find_element(By.ID, "pull-repo").send_keys("tiny-org/not-there")
            browser.find_element(By.ID, "pull-button").click()
            wait_for(lambda: "no repo 'tiny-org/not-there'"
                     in browser.find_element(By.ID, "pull-status").text, "the pull's error")
            assert "error" in browser.find_element(By.ID, "pull-status").get_attribute("class")
            assert console_errors(browser) == []


def test_an_image_in_chat_reaches_a_vision_model(tmp_path, browser, artifacts):
    """The image button on a tiny Gemma 3 vision model: the request carries the image (its
    prompt is longer than the same text alone by the image's tokens) and an answer streams."""
    pytest.importorskip("mlx_vlm")
    from PIL import Image

    from rewind.testing.tiny_vision import IMAGE_TOKENS, build_tiny_vision_model

    folder = build_tiny_vision_model(tmp_path / "tiny-vision")
    picture = tmp_path / "picture.png"
    Image.new("RGB", (64, 48), (200, 40, 90)).save(picture)
    question = "What is in this picture?"
    with tiny_live_server(folder, tmp_path / "scratch") as live:
        browser.get(f"{live.url}/")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#model-select option"),
                 "the model picker")
        box = browser.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys("6")
        # The file input sits hidden inside its label (the label is the button); chromedriver
        # types a path into a hidden file input as a user's pick would.
        browser.find_element(By.ID, "image-input").send_keys(str(picture))
        wait_for(lambda: browser.find_element(By.ID, "image-name").text == "picture.png",
                 "the picked image's name")
        answer = send_and_wait(browser, question)
        thumb = browser.find_element(By.CSS_SELECTOR, "#messages .message.user img.thumb")
        assert thumb.get_attribute("src").startswith("data:image/png;base64,")
        prompt, _ = cached_of(answer)
        text_only = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": question}], "max_tokens": 1,
            "temperature": 0}).json()["usage"]["prompt_tokens"]
        assert prompt >= text_only + IMAGE_TOKENS
        answered = re.search(r"answer (\d+) tokens", answer.find_element(By.CSS_SELECTOR, ".usage").text)
        assert answered and int(answered.group(1)) > 0
        assert browser.find_element(By.ID, "image-name").text == ""  # the pick is spent
        browser.save_screenshot(str(artifacts / "chat-image.png"))
        assert console_errors(browser) == []
