"""A5 in a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by Selenium
against the real server. Enter the session key, load the default model (SmolLM2), watch a download
from the fake hub reach 100 %, chat with a streamed answer, look at the dashboard. Screenshots are
kept under the test's tmp dir and copied to `.screens/` in the checkout (git-ignored)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.loading.fake_hub import FakeHub
from tests.server.webui_fixtures import SESSION_KEY, WebUiServer, fake_hub, start_webui  # noqa: F401

pytestmark = pytest.mark.slow
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENS = Path(__file__).resolve().parents[2] / ".screens"

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no chromium/chromedriver: scripts/setup.sh installs Debian's chromium and chromium-driver",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1440,900", "--no-first-run", f"--user-data-dir={tmp_path / 'chrome'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shoot(driver: webdriver.Chrome, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    try:
        SCREENS.mkdir(exist_ok=True)
        shutil.copy(path, SCREENS / path.name)
    except OSError:
        pass  # a read-only checkout keeps the tmp-dir copy only


def wait_for(driver: webdriver.Chrome, condition: Callable[[webdriver.Chrome], object], timeout: float,
             what: str) -> object:
    """Polls `condition`; the dashboard replaces its tiles on every event, so an element that went
    stale between the find and the read is polled again, not a failure."""
    return WebDriverWait(driver, timeout, poll_frequency=0.25,
                         ignored_exceptions=(StaleElementReferenceException,)).until(condition, message=what)


RECORD_ANSWER_TEXTS = """
window.answerLengths = [];
new MutationObserver(records => {
  for (const record of records) {
    const target = record.target.nodeType === Node.TEXT_NODE ? record.target.parentElement : record.target;
    if (!target?.matches?.(".msg.assistant .content")) continue;
    for (const node of record.addedNodes) window.answerLengths.push(node.textContent.length);
    if (record.type === "characterData") window.answerLengths.push(record.target.data.length);
  }
}).observe(document.getElementById("messages"), { childList: true, subtree: true, characterData: true });
"""


def test_a5_browser_login_load_download_chat_and_dashboard(browser: webdriver.Chrome, tmp_path: Path,
                                                           start_webui: Callable[..., WebUiServer],
                                                           fake_hub: FakeHub) -> None:
    torch.set_num_threads(1)  # two cores shared with the browser: one for the engine
    server = start_webui()
    browser.get(server.address + "/webui/")
    shoot(browser, tmp_path, "01-login")
    browser.find_element(By.ID, "key-input").send_keys("wrong-key")
    browser.find_element(By.ID, "key-submit").click()
    wait_for(browser, lambda d: "not valid" in d.find_element(By.ID, "login-error").text, 10, "a refused key")
    key_input = browser.find_element(By.ID, "key-input")
    key_input.clear()
    key_input.send_keys(SESSION_KEY)
    browser.find_element(By.ID, "key-submit").click()
    wait_for(browser, lambda d: d.find_element(By.ID, "app").is_displayed(), 10, "the app after login")
    row = '#catalog-body tr[data-name="SmolLM2-135M-Instruct"]'
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row), 20, "the default model in the catalog")

    # load the default model (SmolLM2) from its catalog row
    browser.find_element(By.CSS_SELECTOR, f"{row} .act-load").click()
    wait_for(browser, lambda d: d.find_element(By.ID, "served-model").text == "SmolLM2-135M-Instruct", 150,
             "the default model to load")
    wait_for(browser, lambda d: "loaded" in d.find_element(By.CSS_SELECTOR, row).text, 10, "the row marked loaded")

    # download from the fake hub: the job's bar reaches 100 %
    browser.find_element(By.ID, "download-input").send_keys("acme/tiny-llama")
    browser.find_element(By.ID, "download-submit").click()
    done = '.job[data-kind="download"][data-state="succeeded"]'
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, done), 60, "the download job to succeed")
    bar = browser.find_element(By.CSS_SELECTOR, f"{done} .bar")
    assert bar.get_attribute("aria-valuenow") == "100"
    assert browser.find_element(By.CSS_SELECTOR, f"{done} .job-pct").text == "100%"
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#catalog-body tr[data-id="acme/tiny-llama"]'), 10,
             "the downloaded model in the catalog")
    shoot(browser, tmp_path, "02-models")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", bar)
    shoot(browser, tmp_path, "02b-download-done")

    # chat: the answer streams in (seen growing) and ends with its stats line
    browser.find_element(By.CSS_SELECTOR, '.nav[data-page="chat"]').click()
    # Every text the answer's node is given, recorded as the page sets it: a fast model can finish
    # between two polls, but a streamed answer is still set once per delta, growing.
    browser.execute_script(RECORD_ANSWER_TEXTS)
    browser.find_element(By.ID, "chat-input").send_keys("What is the capital of France? Answer in two sentences.")
    browser.find_element(By.ID, "chat-send").click()
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '.msg.assistant[data-done="true"]'), 90,
             "the answer to finish")
    lengths = browser.execute_script("return window.answerLengths")
    answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text
    assert answer.strip() and "error" not in browser.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("class")
    grown = [n for n in lengths if n > 0]
    assert len(set(grown)) >= 2 and grown == sorted(grown), f"the answer did not stream: {lengths}"
    assert "finish:" in browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text
    shoot(browser, tmp_path, "03-chat")

    # dashboard: live tiles from the events stream
    browser.find_element(By.CSS_SELECTOR, '.nav[data-page="dashboard"]').click()
    wait_for(browser, lambda d: d.find_element(By.ID, "m-slots").text == "/ 4", 10, "the slot count")
    wait_for(browser, lambda d: int(d.find_element(By.CSS_SELECTOR, "#counters dd:nth-of-type(3)").text) >= 1, 10,
             "the completed request counted")
    time.sleep(2.5)  # a few samples on the charts
    shoot(browser, tmp_path, "04-dashboard")
    assert "live" in browser.find_element(By.ID, "conn").get_attribute("class")
