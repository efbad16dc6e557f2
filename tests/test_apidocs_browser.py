"""The API documentation pages of a real ``memfuse serve``, ``/docs`` (Swagger UI) and
``/redoc`` (ReDoc), in headless Chromium with every request to anything but the loopback
address blocked (an air-gapped cluster): both pages render the whole API from assets the
server serves itself, and the browser does not even try another host (DevTools network log).
"""
from __future__ import annotations

import json
from urllib.parse import urlsplit

import pytest

from mountutil import ControlPlane
from test_console_browser import WAIT, _chrome

pytestmark = [pytest.mark.browser]

# Every host name resolves to nothing but 127.0.0.1 itself, and every other request goes to a
# proxy that does not exist: nothing leaves the machine (Chromium's net switches).
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
           "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=127.0.0.1")


@pytest.fixture(scope="module")
def docs_browser(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("apidocs")
    cp = ControlPlane(tmp).start()
    driver = None
    try:
        driver = _chrome(tmp / "chrome-profile", *OFFLINE, performance_log=True)
        yield driver, cp
    finally:
        try:
            if driver is not None:
                driver.quit()
        finally:
            cp.stop()


def _requested(driver) -> list[tuple[str, str | None]]:
    """(URL, blocked reason or None) of every request the page made since the last call, from
    the DevTools network log (``requestWillBeSent``; ``loadingFailed`` says why one was
    blocked: ``csp`` when the page's Content-Security-Policy stopped it before it was sent)."""
    sent: dict[str, str] = {}
    blocked: dict[str, str] = {}
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        params = msg.get("params", {})
        if msg.get("method") == "Network.requestWillBeSent":
            sent[params["requestId"]] = params["request"]["url"]
        elif msg.get("method") == "Network.loadingFailed" and params.get("blockedReason"):
            blocked[params["requestId"]] = params["blockedReason"]
    return [(url, blocked.get(rid)) for rid, url in sent.items()]


def _wait(driver, script: str, what: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, WAIT, poll_frequency=0.1).until(lambda d: d.execute_script(script), message=what)
    except Exception:
        print(f"--- waiting for {what} at {driver.current_url}:\n{driver.page_source[:3000]}")
        raise


def _only_loopback(requests: list[tuple[str, str | None]], base: str, allowed_blocked: int = 0) -> None:
    """Every request of the page went to the server itself, but at most ``allowed_blocked``
    that the page's own Content-Security-Policy stopped before they were sent."""
    here = urlsplit(base).netloc
    # the browser's own pages (chrome://, its new-tab page) are not the page's requests
    others = [(u, why) for u, why in requests
              if urlsplit(u).scheme in ("http", "https", "ws", "wss") and urlsplit(u).netloc != here]
    assert all(why == "csp" for _, why in others), f"requests to other hosts: {others}"
    assert len(others) <= allowed_blocked, others


def test_swagger_ui_renders_offline(docs_browser):
    driver, cp = docs_browser
    _requested(driver)
    driver.get(cp.url + "/docs")
    _wait(driver, "return document.querySelector('.swagger-ui .info .title') !== null && "
                  "document.querySelectorAll('.opblock').length > 20", "Swagger UI with the operations")
    title = driver.execute_script("return document.querySelector('.swagger-ui .info .title').textContent")
    assert "memfuse control plane" in title
    paths = driver.execute_script(
        "return Array.from(document.querySelectorAll('.opblock-summary-path')).map(e => e.textContent)")
    assert any("/v1/stores/{store}/records" in p for p in paths)
    # Swagger UI's styles applied (the stylesheet came from the server)
    assert driver.execute_script(
        "return getComputedStyle(document.querySelector('.opblock')).borderStyle") == "solid"
    requests = _requested(driver)
    assert any(u.endswith("/docs/assets/swagger-ui-bundle.js") for u, _ in requests)
    assert any(u.endswith("/openapi.json") for u, _ in requests)
    _only_loopback(requests, cp.url)


def test_redoc_renders_offline(docs_browser):
    driver, cp = docs_browser
    _requested(driver)
    driver.get(cp.url + "/redoc")
    _wait(driver, "return document.querySelector('.api-content h1') !== null && "
                  "document.querySelectorAll('.menu-content li').length > 20", "ReDoc with the operations")
    assert "memfuse control plane" in driver.execute_script(
        "return document.querySelector('.api-content h1').textContent")
    assert "records" in driver.execute_script("return document.querySelector('.menu-content').textContent")
    requests = _requested(driver)
    assert any(u.endswith("/docs/assets/redoc.standalone.js") for u, _ in requests)
    # ReDoc's bundle shows the Redocly logo from its CDN in the menu's footer: the page's
    # Content-Security-Policy stops that request before it is sent (the image is then hidden)
    _only_loopback(requests, cp.url, allowed_blocked=1)
