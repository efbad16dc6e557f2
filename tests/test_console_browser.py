"""The memory console in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``./scripts/setup --test``) driven by Selenium against a real
``memfuse serve``, with a real sidecar mount of the same workspace so what a person does in
the console is checked where agents see it.

One control plane, one mount and one browser for the whole module (the tests run in order and
build on each other's records). Screenshots of the main pages go to the module's tmp dir
(``console-*.png``). In CI a skipped browser test fails the run (see conftest.py).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import httpx
import pytest

from mountutil import ControlPlane, Sidecar, sh, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.mount]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 15  # seconds: upper bound of every wait for the page or the mount (event-driven)


def _chrome(profile: Path, *extra: str, performance_log: bool = False):
    """Headless Chromium under chromedriver (skips the test when either is missing), with
    ``extra`` command-line switches; ``performance_log``: keep the DevTools network events
    (``driver.get_log("performance")``)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service as ChromeService
    except ImportError:
        pytest.skip("selenium missing: ./scripts/setup --test installs the test extras")
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("chromium / chromium-driver missing: ./scripts/setup --test installs them")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,900", f"--user-data-dir={profile}", *extra):
        opts.add_argument(arg)
    if performance_log:
        opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=ChromeService(executable_path=CHROMEDRIVER), options=opts)


class Console:
    """The browser, the control plane, the mount and a few helpers."""

    def __init__(self, driver, cp: ControlPlane, sidecar: Sidecar, shots: Path, ro_token: str) -> None:
        self.d, self.cp, self.sc, self.shots, self.ro_token = driver, cp, sidecar, shots, ro_token
        self.mnt = sidecar.mountpoint

    def open(self, path: str) -> None:
        self.d.get(self.cp.url + path)

    def css(self, selector: str):
        from selenium.webdriver.common.by import By

        return self.d.find_elements(By.CSS_SELECTOR, selector)

    def one(self, selector: str):
        found = self.css(selector)
        assert found, f"no {selector!r} on {self.d.current_url}:\n{self.d.page_source[:3000]}"
        return found[0]

    def link(self, text: str):
        from selenium.webdriver.common.by import By

        return self.d.find_element(By.LINK_TEXT, text)

    def button(self, text: str, scope=None):
        from selenium.webdriver.common.by import By

        for b in (scope or self.d).find_elements(By.CSS_SELECTOR, "button"):
            if b.text.strip() == text:
                return b
        raise AssertionError(f"no button {text!r} on {self.d.current_url}")

    def settle(self) -> None:
        """Wait until the sidecar's outbox is empty: every write made on the mount has reached
        the control plane (so a page opened now will not reload for one of them)."""
        def empty() -> bool:
            status = json.loads((self.mnt / ".memfuse" / "status.json").read_text())
            return status["outbox"]["depth"] == 0
        wait_for(empty, WAIT, "the sidecar's outbox to drain")

    def until(self, pred, what: str) -> None:
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            # A live page may reload (the store changed), or a form submission may replace it,
            # while we look at it: look again. WebDriverException, not only its subclass
            # StaleElementReferenceException, because chromedriver reports an element of the
            # page being replaced as "unknown error: unhandled inspector error: Node with given id
            # does not belong to the document" (seen in CI, Chromium 156); NoSuchElementException
            # is a subclass too. The wait stays bounded by WAIT either way.
            WebDriverWait(self.d, WAIT, poll_frequency=0.05,
                          ignored_exceptions=(WebDriverException, AssertionError)).until(
                              lambda d: pred(), message=what)
        except Exception:
            print(f"--- waiting for {what} at {self.d.current_url}:\n{self.d.page_source[:4000]}")
            raise

    def go(self, element) -> None:
        """Click ``element`` (a form's button or a link) and wait until the page it leads to
        replaced this one. A click returns before the browser has the answer, and the page
        being left may already show what the next check looks for (the same message, the
        same field error): checks made right after a click must see the new page."""
        self.d.execute_script("window.__memfuseLeft = true")  # a new document has no such mark
        element.click()
        self.until(lambda: self.d.execute_script(
            "return window.__memfuseLeft === undefined && document.readyState === 'complete'"),
            "the page the click leads to")

    def text(self) -> str:
        return self.one("main").text

    def shot(self, name: str) -> Path:
        path = self.shots / f"console-{name}.png"
        self.d.save_screenshot(str(path))
        return path

    def api(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.cp.url, timeout=30,
                            headers={"Authorization": f"Bearer {token or self.cp.admin_token}"})

    def record_id(self, path: str, store: str = "default") -> str:
        with self.api() as c:
            r = c.get(f"/v1/stores/{store}/records", params={"path": path})
            r.raise_for_status()
            return r.json()["records"][0]["id"]

    def login(self, token: str) -> None:
        self.open("/ui/")
        if "/ui/login" not in self.d.current_url:
            self.go(self.button("Log out"))
            self.until(lambda: "/ui/login" in self.d.current_url, "logged out")
        self.one("#token").send_keys(token)
        self.go(self.button("Log in"))
        self.until(lambda: "/ui/login" not in self.d.current_url, "logged in")


@pytest.fixture(scope="module")
def console_session(tmp_path_factory):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    tmp = tmp_path_factory.mktemp("console")
    cp = ControlPlane(tmp).start()
    sc = driver = None
    try:
        tok = cp.setup_workspace("ws", ("default",))
        cp.call("create_workspace", "viewer", default_store=False)
        cp.call("attach", "viewer", "default", access="read_only")
        ro_token = cp.call("create_token", workspace="viewer", name="viewer").token
        sc = Sidecar(cp, "ws", tok, tmp / "mnt", tmp / "cache").start(expect="default")
        driver = _chrome(tmp / "chrome-profile")
        yield Console(driver, cp, sc, tmp, ro_token)
    finally:
        try:
            if driver is not None:
                driver.quit()
        finally:
            try:
                if sc is not None:
                    sc.stop()
            finally:
                cp.stop()


@pytest.fixture
def console(console_session):
    """The module's console, on a blank page at the start of each test. A store or record
    page left open by the previous test reloads itself when the store changes (its live
    updates); a test that changes the store and then opens a page would race that reload,
    which can land after the page the test opened (seen under load: the record page replaced
    by the previous test's store page). A test that wants a live page opens it itself."""
    c = console_session
    c.open("/ui/")  # each test runs alone too: log in as the admin where no session is open
    if "/ui/login" in c.d.current_url:
        c.one("#token").send_keys(c.cp.admin_token)
        c.go(c.button("Log in"))
        c.until(lambda: "/ui/login" not in c.d.current_url, "logged in")
    c.d.get("about:blank")
    return c


@pytest.fixture
def logged_out_console(console_session):
    """The module's console with no session: its cookies deleted, on a blank page."""
    c = console_session
    c.open("/ui/login")
    c.d.delete_all_cookies()
    c.d.get("about:blank")
    return c


def test_login_and_stores(logged_out_console):
    c = logged_out_console
    c.open("/ui/")
    assert "/ui/login" in c.d.current_url  # no page without a session
    c.one("#token").send_keys("not-a-token")
    c.go(c.button("Log in"))
    c.until(lambda: "not valid" in c.text(), "the refusal of a bad token")  # page load may lag
    c.one("#token").send_keys(c.cp.admin_token)
    c.go(c.button("Log in"))
    c.until(lambda: c.d.current_url.endswith("/ui/"), "the stores page")
    cookie = c.d.get_cookie("memfuse_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui/"
    assert c.cp.admin_token not in cookie["value"]  # a session id, never the token
    assert c.d.execute_script("return document.cookie") == ""  # no script can read it
    side = c.one(".sidebar").text
    assert "default" in side and "records" in side and "MiB" in side


def test_store_record_history_diff_restore_reaches_mount(console):
    c = console
    store = c.mnt / "default"
    sh("printf '# Index\\n- [prefs](prefs.md): drink preferences\\n' > MEMORY.md", store)
    sh("echo 'prefers tea' > prefs.md", store)
    sh("sed -i s/tea/coffee/ prefs.md", store)
    sh("sync prefs.md", store, timeout=60)  # committed (fsync waits for the control plane)
    c.settle()
    c.open("/ui/stores/default")
    index = c.one("section.index").text
    assert "Index" in index and "drink preferences" in index  # MEMORY.md first, rendered
    c.until(lambda: "prefs.md" in c.one("table.records").text, "prefs.md in the list")
    row = [r for r in c.css("table.records tbody tr") if "prefs.md" in r.text][0]
    assert "project" in row.text and "ws:ws/" in row.text  # type, last change actor
    c.shot("store")
    c.go(c.link("prefs.md"))
    c.until(lambda: "History" in c.text(), "the record page")
    assert "prefers coffee" in c.one("section.content").text
    history = c.one("table.history").text
    assert "created" in history and "modified" in history
    c.shot("record")
    record_url = c.d.current_url
    c.go(c.button("Diff"))  # the defaults: previous → current
    c.until(lambda: c.css("table.diff.unified"), "the diff")
    cells = lambda sel: [e.text for e in c.css(sel)]  # noqa: E731
    assert cells("table.diff tr.d-del td") == ["1", "", "prefers tea"]  # old line 1, no new line
    assert cells("table.diff tr.d-add td") == ["", "1", "prefers coffee"]
    assert cells("table.diff tr.d-del mark") == ["tea"] and cells("table.diff tr.d-add mark") == ["coffee"]
    sign = c.d.execute_script("return getComputedStyle(document.querySelector('tr.d-add td.code'), '::before').content")
    assert sign == '"+"'  # the +/- column is drawn, not copied with the text
    mono = c.d.execute_script("return getComputedStyle(document.querySelector('table.diff td.code')).fontFamily")
    assert "monospace" in mono
    c.shot("diff")
    c.go(c.link("Side by side"))
    c.until(lambda: c.css("table.diff.split"), "the side-by-side diff")
    rows = [[td.text for td in tr.find_elements("css selector", "td")] for tr in c.css("table.diff.split tbody tr")]
    assert ["1", "prefers tea", "1", "prefers coffee"] in rows
    assert cells("table.diff td.d-del mark") == ["tea"] and cells("table.diff td.d-add mark") == ["coffee"]
    c.shot("diff-split")
    c.d.get(record_url)
    row = [r for r in c.css("table.history tbody tr") if r.text.split()[0] == "2"][0]
    c.go(row.find_element("link text", "Diff with previous"))
    c.until(lambda: "Version 1 → version 2" in c.text(), "the diff with the previous version")
    assert cells("table.diff tr.d-add td.code") == ["prefers coffee"]
    c.d.get(record_url)
    row = [r for r in c.css("table.history tbody tr") if r.text.split()[0] == "1"][0]
    c.go(c.button("Restore", row))
    c.until(lambda: "Restored" in c.text(), "the restore message")
    assert "restored" in c.one("table.history").text
    # the sidecar sees it through the change feed
    wait_for(lambda: (store / "prefs.md").read_text() == "prefers tea\n", WAIT, "the restore on the mount")


def test_edit_with_a_type_reaches_mount(console):
    c = console
    from selenium.webdriver.support.ui import Select

    rid = c.record_id("prefs.md")
    c.open(f"/ui/stores/default/records/{rid}/edit")
    options = [o.get_attribute("value") for o in Select(c.one("#type")).options]
    assert options == ["user", "feedback", "project", "reference"]  # the four types, nothing else
    Select(c.one("#type")).select_by_value("user")
    area = c.one("#content")
    assert "monospace" in c.d.execute_script("return getComputedStyle(arguments[0]).fontFamily", area)
    area.clear()
    area.send_keys("prefers green tea\nno sugar\n")
    c.shot("edit")
    c.go(c.button("Save"))
    c.until(lambda: "Saved" in c.text(), "the save message")
    assert "user" in c.one("dl.meta").text
    wait_for(lambda: (c.mnt / "default" / "prefs.md").read_text() == "prefers green tea\nno sugar\n",
             WAIT, "the edit on the mount (LF line endings, not the browser's CRLF)")
    with c.api() as api:
        assert api.get(f"/v1/stores/default/records/{rid}").json()["type"] == "user"


def test_create_needs_a_type(console):
    c = console
    from selenium.webdriver.support.ui import Select

    c.open("/ui/stores/default/new")
    c.one("#path").send_keys("team/feedback.md")
    c.one("#content").send_keys("keep answers short\n")
    # the browser refuses the form without a type (required); the server refuses it too
    c.d.execute_script("document.getElementById('type').removeAttribute('required')")
    c.go(c.button("Create"))
    c.until(lambda: c.css(".field-error"), "the type error")
    assert "Choose a type" in c.one(".field-error").text
    assert c.one("#content").get_attribute("value") == "keep answers short\n"  # nothing typed is lost
    Select(c.one("#type")).select_by_value("feedback")
    c.go(c.button("Create"))
    c.until(lambda: "Created" in c.text(), "the create message")
    assert "feedback" in c.one("dl.meta").text
    wait_for(lambda: (c.mnt / "default" / "team" / "feedback.md").exists(), WAIT, "the new file on the mount")
    c.settle()


def test_search_and_filter(console):
    c = console
    c.open("/ui/stores/default?text=ANSWERS")  # content, case-insensitive
    assert [e.text for e in c.css("table.records td.path")] == ["team/feedback.md"]
    c.open("/ui/stores/default?type=user")
    assert [e.text for e in c.css("table.records td.path")] == ["prefs.md"]
    c.open("/ui/stores/default?path=50%25")  # a literal %, not a wildcard
    assert "No record matches" in c.text()


def test_xss_record_renders_inert(console):
    c = console
    evil = (
        "# Notes\n\n<script>window.__xss = 1</script>\n\n"
        "<img src=x onerror=\"window.__xss = 2\">\n\n"
        "[click me](javascript:window.__xss=3)\n\n"
        "<a href=\"javascript:window.__xss=4\">raw link</a>\n\n"
        "[ok](https://example.invalid/page)\n"
    )
    with c.api() as api:
        r = api.post("/v1/stores/default/records", json={"path": "evil.md", "content": evil, "type": "reference"})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        r = api.post("/v1/stores/default/records", json={"path": "evil.txt", "content": evil, "type": "reference"})
        assert r.status_code == 201, r.text
        rid_txt = r.json()["id"]
    for record in (rid, rid_txt):
        c.open(f"/ui/stores/default/records/{record}")
        c.until(lambda: "History" in c.text(), "the record page")
        assert c.d.execute_script("return window.__xss === undefined")
        assert c.d.execute_script("return document.querySelectorAll('main script, main [onerror]').length") == 0
        hrefs = c.d.execute_script(
            "return Array.from(document.querySelectorAll('main a')).map(a => a.getAttribute('href') || '')")
        assert not [h for h in hrefs if h.strip().lower().startswith("javascript:")], hrefs
        assert "<script>window.__xss = 1</script>" in c.text()  # shown as text
        for link in c.css("main a"):  # nothing a person can click runs code
            assert "__xss" not in (link.get_attribute("href") or "")
    c.open(f"/ui/stores/default/records/{rid}")
    assert c.one(".markdown a[href='https://example.invalid/page']").get_attribute("rel") == \
        "noopener noreferrer nofollow"
    c.shot("xss")


def test_stale_edit_is_not_overwritten(console):
    c = console
    rid = c.record_id("prefs.md")
    c.open(f"/ui/stores/default/records/{rid}/edit")
    # someone changes the file on the mount meanwhile
    sh("echo 'and oat milk' >> prefs.md && sync prefs.md", c.mnt / "default", timeout=60)
    c.settle()
    area = c.one("#content")
    area.clear()
    area.send_keys("prefers water\n")
    c.go(c.button("Save"))
    c.until(lambda: "changed while you were editing" in c.text(), "the stale-edit notice")
    assert "+and oat milk" in [e.text for e in c.css("pre.diff .d-add")]
    assert c.one("#content").get_attribute("value") == "prefers water\n"  # the typed text is kept
    c.shot("stale")
    with c.api() as api:
        assert api.get(f"/v1/stores/default/records/{rid}").json()["content"].endswith("and oat milk\n")
    c.go(c.button("Save anyway"))  # now knowingly
    c.until(lambda: "Saved" in c.text(), "the save message")
    wait_for(lambda: (c.mnt / "default" / "prefs.md").read_text() == "prefers water\n", WAIT, "the save on the mount")


def test_refusals_shown_next_to_the_field(console):
    c = console
    rid = c.record_id("prefs.md")
    c.open(f"/ui/stores/default/records/{rid}/edit")
    area = c.one("#content")
    area.clear()
    token = "ghp_" + "".join(secrets.choice("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789")
                             for _ in range(36))
    area.send_keys(f"my token is {token}\n")
    c.go(c.button("Save"))
    c.until(lambda: c.css("#content-error"), "the refusal")
    assert "GitHub token on line 1" in c.one("#content-error").text  # the mount's EPERM reason
    assert token not in c.one("#content-error").text
    # oversize against the store's per-record limit
    with c.api() as api:
        assert api.patch("/v1/stores/default", json={"max_record_bytes": 2048}).status_code == 200
    try:
        area = c.one("#content")
        area.clear()
        c.d.execute_script("arguments[0].value = 'x'.repeat(3000)", area)
        c.go(c.button("Save"))
        c.until(lambda: c.css("#content-error"), "the refusal")
        assert "3000 bytes, the store allows 2048" in c.one("#content-error").text
    finally:
        with c.api() as api:
            assert api.patch("/v1/stores/default", json={"max_record_bytes": 1 << 20}).status_code == 200
    assert (c.mnt / "default" / "prefs.md").read_text() == "prefers water\n"  # nothing stored


def test_store_page_updates_live(console):
    c = console
    c.open("/ui/stores/default")
    c.until(lambda: c.d.execute_script("return document.readyState") == "complete", "page load")
    time.sleep(0.3)  # let the EventSource connect (it would also catch up from the page's seq)
    sh("echo 'fresh' > live-note.md", c.mnt / "default")
    c.until(lambda: any("live-note.md" in e.text for e in c.css("table.records td.path")),
            "the new record to appear without a click")
    c.settle()


def test_a_page_being_left_does_not_reload_itself(console):
    """A store page someone is leaving (a link followed, the next page still on its way)
    does not reload itself when the store changes meanwhile: the reload would cancel the
    navigation and keep them on the old page."""
    import http.server
    import threading

    c = console
    changed = []

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/elsewhere":  # the browser's own asks (/favicon.ico): not ours
                self.send_error(404)
                return
            # the navigation away has started: the store changes now, and the answer comes
            # after the page being left had the time to hear of it (its event comes at once)
            with c.api() as api:
                r = api.post("/v1/stores/default/records", json={"path": "meanwhile.md", "content": "x\n"})
                changed.append(r.status_code)
            time.sleep(1.0)
            body = b"<!doctype html><title>elsewhere</title><p>elsewhere</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        c.open("/ui/stores/default")
        away = f"http://127.0.0.1:{srv.server_address[1]}/elsewhere"
        c.d.execute_script("location.href = arguments[0]", away)  # what following a link does
        c.until(lambda: c.d.current_url == away and "elsewhere" in c.d.find_element("tag name", "body").text,
                "the page that was asked for")
        assert changed == [201]
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(WAIT)
    with c.api() as api:
        assert api.delete(f"/v1/stores/default/records/{c.record_id('meanwhile.md')}").status_code == 204
    wait_for(lambda: not (c.mnt / "default" / "meanwhile.md").exists(), WAIT, "the deletion on the mount")


def test_prompt_preview_shows_the_omission_marker(console):
    c = console
    long_index = "# Index\n" + "".join(f"- [note {i}](n{i}.md): something worth remembering\n" for i in range(260))
    (c.mnt / "default" / "MEMORY.md").write_text(long_index)
    sh("sync MEMORY.md", c.mnt / "default", timeout=60)
    c.settle()
    c.open("/ui/workspaces/ws/context")
    marks = c.css("pre.context mark.omission")
    assert marks and "MEMORY.md is cut here" in marks[0].text
    with c.api() as api:
        block = api.get("/v1/workspaces/ws/context").text
    assert c.one("pre.context").get_attribute("textContent") == block  # exactly what the agents get
    c.shot("context")


def test_workspace_attachments(console):
    c = console
    c.open("/ui/workspaces/viewer")
    row = [r for r in c.css("table.list tbody tr") if "default" in r.text][0]
    assert "read-only" in row.text
    c.go(c.button("Make read-write", row))
    c.until(lambda: "Attachment saved" in c.text(), "saved")
    row = [r for r in c.css("table.list tbody tr") if "default" in r.text][0]
    assert "read-write" in row.text
    c.shot("workspace")
    c.go(c.button("Make read-only", row))
    c.until(lambda: "Attachment saved" in c.text(), "saved")
    with c.api() as api:
        atts = api.get("/v1/workspaces/viewer/attachments").json()
    assert [(a["store"]["slug"], a["access"]) for a in atts] == [("default", "read_only")]


def test_store_settings_edit(console):
    """(admin) the store page's settings form: bad values are refused by their field with
    nothing changed; good ones are saved and reach the sidecar (its status shows the limit)."""
    c = console
    with c.api() as api:
        before = api.get("/v1/stores/default").json()

    def field(name: str):
        return c.one(f"#s-{name}")

    def fill(**values: str) -> None:
        for name, value in values.items():
            el = field(name)
            el.clear()
            el.send_keys(value)

    try:
        c.open("/ui/stores/default")
        assert not field("max_records").is_displayed()  # folded until asked for
        c.one("details.settings summary").click()
        assert field("max_record_bytes").get_attribute("value") == str(before["max_record_bytes"])
        fill(max_record_bytes="lots", max_records="-5")
        c.go(c.button("Save settings"))
        c.until(lambda: "Nothing was changed" in c.text(), "the refusal")
        errors = [e.text for e in c.css("details.settings .field-error")]
        assert "'lots' is not a byte size (e.g. 1048576, 512K, 1MiB)" in errors
        assert "must be at least 1" in errors
        assert field("max_record_bytes").get_attribute("value") == "lots"  # what was typed stays
        with c.api() as api:
            assert api.get("/v1/stores/default").json() == before
        fill(max_record_bytes="256K", max_records="777", description="shared team memory")
        from selenium.webdriver.support.ui import Select
        Select(field("default_type")).select_by_visible_text("reference")
        c.go(c.button("Save settings"))
        c.until(lambda: "Store settings saved." in c.text(), "saved")
        assert "777 records" in c.one(".usage-line").text and "256 KiB per record" in c.one(".usage-line").text
        assert "shared team memory" in c.text()
        with c.api() as api:
            got = api.get("/v1/stores/default").json()
        assert (got["max_record_bytes"], got["max_records"], got["default_type"], got["description"]) == (
            256 << 10, 777, "reference", "shared team memory")
        assert got["max_store_bytes"] == before["max_store_bytes"]

        def sidecar_limit() -> bool:
            st = json.loads((c.mnt / ".memfuse" / "status.json").read_text())
            return [s["max_records"] for s in st["stores"] if s["slug"] == "default"] == [777]
        wait_for(sidecar_limit, WAIT, "the sidecar to get the new limit")
    finally:
        with c.api() as api:
            r = api.patch("/v1/stores/default", json={k: before[k] for k in (
                "description", "default_type", "max_record_bytes", "max_store_bytes", "max_records")})
            assert r.status_code == 200


def test_read_only_workspace_cannot_edit(console):
    c = console
    rid = c.record_id("prefs.md")
    c.login(c.ro_token)
    assert "workspace viewer" in c.one(".who").text
    c.open("/ui/stores/default")
    assert "read-only" in c.text()
    assert not c.css("details.settings")  # the store's settings are the admin's
    assert not [b for b in c.css("main a.button, main button") if b.text in ("New record", "Edit", "Delete")]
    c.open(f"/ui/stores/default/records/{rid}")
    assert not [b for b in c.css("main a, main button") if b.text.strip() in ("Edit", "Delete", "Restore", "Redact")]
    c.open(f"/ui/stores/default/records/{rid}/edit")
    assert "read-only" in c.text()
    with httpx.Client(base_url=c.cp.url, headers={"Authorization": f"Bearer {c.ro_token}"}) as api:
        r = api.post(f"/ui/stores/default/records/{rid}/edit", data={"content": "hacked\n"})
        assert r.status_code == 403 and "read-only" in r.text
        r = api.post(f"/ui/stores/default/records/{rid}/restore", data={"version": "1"})
        assert r.status_code == 403
    assert (c.mnt / "default" / "prefs.md").read_text() == "prefers water\n"
    c.login(c.cp.admin_token)


def test_logout_ends_the_session_and_the_old_cookie_is_refused(console):
    """Log in, log out: the session is over on the server, so the cookie the browser had
    (copied before the logout, or put back into the browser) opens nothing any more."""
    c = console
    c.login(c.cp.admin_token)
    c.open("/ui/stores/default")
    c.until(lambda: "MEMORY.md" in c.text() or "records" in c.text(), "the store page")
    old = c.d.get_cookie("memfuse_session")["value"]
    with httpx.Client(base_url=c.cp.url, timeout=30, cookies={"memfuse_session": old}) as other:
        assert other.get("/ui/stores/default").status_code == 200  # the copied cookie works now
    c.go(c.button("Log out"))
    c.until(lambda: "/ui/login" in c.d.current_url and "Logged out" in c.d.page_source, "the login page")
    assert c.d.get_cookie("memfuse_session") is None  # the browser dropped it
    with httpx.Client(base_url=c.cp.url, timeout=30, cookies={"memfuse_session": old}) as other:
        r = other.get("/ui/stores/default")
        assert r.status_code == 303 and "/ui/login" in r.headers["location"]  # refused by the server
    # put back into the browser: still the login page
    c.d.add_cookie({"name": "memfuse_session", "value": old, "path": "/ui/", "httpOnly": True,
                    "sameSite": "Strict"})
    c.open("/ui/stores/default")
    c.until(lambda: "/ui/login" in c.d.current_url, "the login page for the old cookie")
    assert "prefers" not in c.d.page_source


def test_redact_asks_for_confirmation(console):
    """Redact is a link to a confirmation page (no JavaScript) that names the version and what
    is lost; Cancel changes nothing; only its button redacts."""
    c = console
    with c.api() as api:
        r = api.post("/v1/stores/default/records", json={"path": "leak.md", "content": "api key was here\n",
                                                          "type": "project"})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        r = api.put(f"/v1/stores/default/records/{rid}", json={"content": "clean now\n"},
                    headers={"If-Match": f'"{r.json()["sha256"]}"'})
        assert r.status_code == 200, r.text
    c.login(c.cp.admin_token)
    c.open(f"/ui/stores/default/records/{rid}")
    c.until(lambda: "History" in c.text(), "the record page")
    row = [r for r in c.css("table.history tbody tr") if r.text.split()[0] == "1"][0]
    assert not [b for b in row.find_elements("css selector", "button") if "Redact" in b.text]  # no one-click
    c.go(row.find_element("link text", "Redact…"))
    c.until(lambda: "Redact version 1 of" in c.text(), "the confirmation page")
    page = c.text()
    assert "leak.md" in page and "no undo" in page and "17 bytes" in page
    assert "for good" in page
    c.shot("redact-confirm")
    c.go(c.link("Cancel"))
    c.until(lambda: "History" in c.text(), "back on the record page")
    with c.api() as api:
        assert api.get(f"/v1/stores/default/records/{rid}/versions/1").json()["content"] == "api key was here\n"
    c.open(f"/ui/stores/default/records/{rid}/versions/1/redact")
    c.go(c.button("Redact version 1 for good"))
    c.until(lambda: "Redacted" in c.text(), "the redacted message")
    with c.api() as api:
        v = api.get(f"/v1/stores/default/records/{rid}/versions/1").json()
        assert v["redacted"] is True and v["content"] is None


def test_long_history_is_paged(console):
    """A record with 120 versions (made 100 updates a request): its page lists the newest 50,
    *Older versions…* the 50 before, then the last 20 with no further link; *Newest
    versions* goes back; the diff form takes any two version numbers."""
    c = console
    with c.api() as api:
        r = api.post("/v1/stores/default/records", json={"path": "long.md", "content": "v1\n", "type": "project"})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        for lo in (2, 102):
            ops = [{"op": "update", "record_id": rid, "body": {"content": f"v{n}\n"}} for n in range(lo, min(lo + 100, 121))]
            assert api.post("/v1/stores/default/batch", json={"operations": ops}).status_code == 200
    c.open(f"/ui/stores/default/records/{rid}")
    c.until(lambda: "History" in c.text(), "the record page")
    numbers = lambda: [int(r.text.split()[0]) for r in c.css("table.history tbody tr")]  # noqa: E731
    assert numbers() == list(range(120, 70, -1)) and not c.css("a.newest-versions")
    c.go(c.link("Older versions…"))
    c.until(lambda: numbers() == list(range(70, 20, -1)), "the 50 older versions")
    c.go(c.link("Older versions…"))
    c.until(lambda: numbers() == list(range(20, 0, -1)), "the oldest 20")
    assert not c.css("a.older-versions")
    c.go(c.link("Newest versions"))
    c.until(lambda: numbers() == list(range(120, 70, -1)), "the newest again")
    a, b = c.one('form.filters input[name="a"]'), c.one('form.filters input[name="b"]')
    assert (a.get_attribute("value"), b.get_attribute("value")) == ("119", "120")
    a.clear()
    a.send_keys("3")
    c.go(c.button("Diff"))
    c.until(lambda: "Version 3 → version 120" in c.text(), "the diff of versions far apart")
    assert [e.text for e in c.css("table.diff tr.d-add td.code")] == ["v120"]


LONG_PATH = "notes/projects/memfuse-console-on-a-phone/meeting-minutes-archive/JOURNAL.jsonl"


def _fits_the_screen(c, page: str) -> None:
    """No horizontal overflow: the document is no wider than the window (a phone at 390 px)."""
    wide = c.d.execute_script(
        "return Array.from(document.querySelectorAll('body *')).filter(e => e.getBoundingClientRect().right"
        " > window.innerWidth + 1).map(e => e.tagName + '.' + e.className + ' ' + e.getBoundingClientRect().right)"
        ".slice(0, 8)")
    fits = c.d.execute_script("return document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    assert fits, f"{page} is wider than the screen: {wide}"


def _path_wraps_at_slashes(c, selector: str) -> None:
    """The element showing LONG_PATH wraps onto several lines, and its last name
    (``JOURNAL.jsonl``) stays on one line: the breaks are at ``/``, never inside a name."""
    lines = c.d.execute_script("""
        const el = Array.from(document.querySelectorAll(arguments[0]))
            .find(e => e.textContent.trim().endsWith('JOURNAL.jsonl'));
        if (!el) return null;
        const whole = document.createRange(); whole.selectNodeContents(el);
        const last = Array.from(el.childNodes).filter(n => n.nodeType === 3 && n.textContent.trim()).pop();
        const name = document.createRange(); name.selectNodeContents(last);
        const tops = rects => new Set(Array.from(rects).map(r => Math.round(r.top))).size;
        return [tops(whole.getClientRects()), tops(name.getClientRects()), last.textContent.trim()];""", selector)
    assert lines is not None, f"no {selector} showing {LONG_PATH} on {c.d.current_url}"
    assert lines[0] > 1 and lines[1] == 1 and lines[2] == "JOURNAL.jsonl", lines


def test_phone_layout(console):
    c = console
    c.login(c.cp.admin_token)  # the admin sees every page and every button
    with c.api() as api:
        r = api.post("/v1/stores/default/records",
                     json={"path": LONG_PATH, "content": '{"event": "first"}\n', "type": "project"})
        assert r.status_code == 201, r.text
        rid_long = r.json()["id"]
        r = api.put(f"/v1/stores/default/records/{rid_long}",
                    json={"content": '{"event": "second, and a much longer line than the first one was"}\n'})
        assert r.status_code == 200, r.text
    rid = c.record_id("prefs.md")
    c.d.set_window_size(390, 844)
    try:
        assert c.d.execute_script("return window.innerWidth") <= 400
        c.open("/ui/stores/default?path=JOURNAL")
        _fits_the_screen(c, "the store page")
        _path_wraps_at_slashes(c, "table.records td.path a")
        side = c.one(".sidebar").rect
        main = c.one("main").rect
        assert side["y"] < main["y"]  # stores above the records on a narrow screen
        c.shot("phone-store")
        c.open("/ui/stores/default")
        _fits_the_screen(c, "the store page, unfiltered")
        c.open(f"/ui/stores/default/records/{rid}")
        _fits_the_screen(c, "the record page")
        for b, name in ((c.button("Restore"), "Restore"), (c.link("Redact…"), "Redact…")):  # on screen,
            # not behind a sideways scroll (Redact is a link to its confirmation page)
            assert 0 <= b.rect["x"] and b.rect["x"] + b.rect["width"] <= 390, (name, b.rect)
        assert c.one("table.history thead").is_displayed() is False  # stacked cards, labelled fields
        c.shot("phone-record")
        c.open(f"/ui/stores/default/records/{rid_long}")
        _fits_the_screen(c, "a long path's record page")
        _path_wraps_at_slashes(c, "h1.path")
        _path_wraps_at_slashes(c, "table.history td.path")
        for view in ("unified", "split"):
            c.open(f"/ui/stores/default/records/{rid_long}/diff?a=1&b=2&view={view}")
            _fits_the_screen(c, f"the {view} diff")
            assert c.css(f"table.diff.{view} mark")
            c.shot(f"phone-diff-{view}")
        for page in (f"/ui/stores/default/records/{rid_long}/edit", "/ui/", "/ui/stores/default/new",
                     "/ui/workspaces", "/ui/workspaces/ws", "/ui/workspaces/ws/context"):
            c.open(page)
            _fits_the_screen(c, page)
        c.shot("phone-edit")
    finally:
        c.d.set_window_size(1280, 900)
    for p in c.shots.glob("console-*.png"):
        assert p.stat().st_size > 5000
    keep = os.environ.get("MEMFUSE_CONSOLE_SHOTS")
    if keep:  # copy the screenshots out (docs/ uses two of them)
        Path(keep).mkdir(parents=True, exist_ok=True)
        for p in c.shots.glob("console-*.png"):
            shutil.copy(p, keep)
    assert re.search(r"console-store\.png", " ".join(p.name for p in c.shots.glob("*.png")))


def test_root_switches_between_accounts_with_same_named_stores(console):
    """Two accounts each with a store ``notes`` (the key of the second is not its name): the
    root admin over every account sees both, each in its own row with its account, and each
    row's link, and every link inside, stays on that account's store; the header's account
    switch shows one account, its ``notes`` only, and back. Runs last: it adds accounts."""
    c = console
    c.login(c.cp.admin_token)
    with c.api() as api:
        for acct in ("alpha", "bravo"):
            assert api.post("/v1/accounts", json={"slug": acct}).status_code == 201
            h = {"X-Memfuse-Account": acct}
            assert api.post("/v1/stores", json={"slug": "notes"}, headers=h).status_code == 201
            r = api.post("/v1/stores/notes/records", headers=h,
                         json={"path": "who.md", "content": f"the notes of {acct}\n", "type": "project"})
            assert r.status_code == 201, r.text
    c.open("/ui/")
    assert "account all" in c.one("header").text
    rows = {r.text.split()[0]: r for r in c.css("table.list tbody tr") if "notes" in r.text}
    assert set(rows) == {"alpha", "bravo"}, [r.text for r in c.css("table.list tbody tr")]
    for acct in ("bravo", "alpha"):
        c.open("/ui/")
        row = [r for r in c.css("table.list tbody tr") if r.text.split()[0] == acct and "notes" in r.text][0]
        from selenium.webdriver.common.by import By

        c.go(row.find_element(By.LINK_TEXT, "notes"))
        assert c.d.current_url.endswith(f"/ui/stores/notes~{acct}"), c.d.current_url
        c.go(c.link("who.md"))
        c.until(lambda: f"the notes of {acct}" in c.text(), f"{acct}'s record")
        other = "alpha" if acct == "bravo" else "bravo"
        assert f"the notes of {other}" not in c.text()
        c.go(c.one("main").find_element(By.LINK_TEXT, "notes"))  # the crumb back: the same account's store
        assert c.d.current_url.endswith(f"/ui/stores/notes~{acct}"), c.d.current_url
    c.shot("root-all-accounts")
    # the switch: one account, its store by its bare name
    from selenium.webdriver.support.ui import Select

    Select(c.one('select[name="account"]')).select_by_value("bravo")
    c.go(c.button("Switch"))
    c.until(lambda: "account bravo" in c.one("header").text, "acting in bravo")
    side = c.one(".sidebar").text
    assert "notes" in side and "default" not in side, side
    c.go(c.link("notes"))
    assert c.d.current_url.endswith("/ui/stores/notes"), c.d.current_url
    c.go(c.link("who.md"))
    c.until(lambda: "the notes of bravo" in c.text(), "bravo's record")
    Select(c.one('select[name="account"]')).select_by_value("")
    c.go(c.button("Switch"))
    c.until(lambda: "account all" in c.one("header").text, "every account again")
