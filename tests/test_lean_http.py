"""The client's lean HTTP/1.1 path (``memfuse/client/lean.py``, ``ApiClient(lean=True)``: the
sidecar's commits) answers and fails exactly as the httpx path does: against a real
``memfuse serve`` (records, batch, refusals, authentication, the instance header, connection
reuse) and against hand-made servers that misbehave on the wire (refused connection, no
answer, a connection closed before or after an answer, garbage, 503 with ``Retry-After``).
Each case runs through both paths and compares what the caller sees."""
from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from memfuse.client import ApiClient
from memfuse.errors import ApiError, Conflict, PreconditionFailed, TransientError, Unauthorized

from mountcheck import hyp_settings
from mountutil import ControlPlane


def _both(url: str, token: str | None, **kw: Any) -> tuple[ApiClient, ApiClient]:
    lean = ApiClient(url, token, lean=True, **kw)
    assert lean._lean is not None
    plain = ApiClient(url, token, **kw)
    assert plain._lean is None
    return lean, plain


def _shape(err: BaseException) -> tuple[Any, ...]:
    assert isinstance(err, ApiError), repr(err)
    return (type(err).__name__, err.status, err.code, err.retry_after)


async def _outcome(call: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await call()
    except ApiError as e:
        return _shape(e)


@pytest.fixture
def cp(tmp_path):
    c = ControlPlane(tmp_path).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.timeout(120)
def test_lean_path_against_memfuse_serve(cp):
    """Creates, updates, appends, a batch and reads through the lean path over one pooled
    connection; refusals (409, 412, 401, 404) raise the same classes and codes as through
    httpx; the instance header reaches the version's actor."""
    token = cp.setup_workspace("ws").read_text().strip()
    trio.run(_against_serve, cp.url, token)


async def _against_serve(url: str, token: str) -> None:
    lean, plain = _both(url, token, instance="lean-1")
    async with lean, plain:
        recs = [await lean.create_record("default", f"n/{i}.md", f"# {i}\n", idempotency_key=f"k{i}")
                for i in range(20)]
        assert lean._lean is not None and lean._lean.connections_opened == 1
        assert recs[0].updated_by.endswith("/lean-1")
        # the same key answers the same record (the stored response), through either path
        again = await plain.create_record("default", "n/0.md", "# 0\n", idempotency_key="k0")
        assert again.id == recs[0].id and again.sha256 == recs[0].sha256
        r = await lean.update_record("default", recs[1].id, "# 1 bis\n", if_match=recs[1].sha256)
        r = await lean.append_record("default", r.id, "more\n", if_match=r.sha256)
        got = await plain.get_record("default", r.id)
        assert got.content == "# 1 bis\nmore\n" and got.sha256 == r.sha256
        ops = [lean.batch_create(f"b/{i}.md", f"b{i}\n", idempotency_key=f"b{i}") for i in range(5)]
        out = await lean.batch("default", ops)
        assert all(getattr(o, "path", None) == f"b/{i}.md" for i, o in enumerate(out))
        for call in (lambda c: c.create_record("default", "n/3.md", "dup\n"),
                     lambda c: c.update_record("default", recs[4].id, "x\n", if_match="0" * 64),
                     lambda c: c.create_record("nostore", "a.md", "x\n"),
                     lambda c: c.delete_record("default", "r_missing")):
            a, b = await _outcome(lambda: call(lean)), await _outcome(lambda: call(plain))
            assert a == b, (a, b)
        with pytest.raises(Conflict):
            await lean.create_record("default", "n/5.md", "dup\n")
        with pytest.raises(PreconditionFailed):
            await lean.update_record("default", recs[6].id, "x\n", if_match="1" * 64)
        assert lean._lean.connections_opened == 1  # refusals keep the connection
    bad_lean, bad_plain = _both(url, "mf_not_a_token")
    async with bad_lean, bad_plain:
        a = await _outcome(lambda: bad_lean.create_record("default", "z.md", "x\n"))
        b = await _outcome(lambda: bad_plain.create_record("default", "z.md", "x\n"))
        assert a == b and a[0] == Unauthorized.__name__
        assert bad_lean.auth_failure is not None and bad_lean.auth_failures == 1


# ---------------------------------------------------------------- misbehaving servers

@pytest.mark.timeout(120)
def test_a_body_over_the_servers_bound_is_its_413_not_a_write_error(tmp_path):
    """A record write whose body is over the front door's bound (its declared length; here
    ``--max-body 7MiB``): the server answers 413 ``too_large`` and closes without reading
    the body, so the send of its 30 MiB breaks. The lean path reads that answer (as httpx
    does): a permanent refusal, never a ``write_error`` the sidecar would retry for ever as
    an outage (attack 12, A2). The connection that broke is not reused; the next small
    write goes through."""
    cp = ControlPlane(tmp_path, extra_args=("--max-body", "7MiB")).start()
    try:
        token = cp.setup_workspace("ws").read_text().strip()
        trio.run(_over_the_bound, cp.url, token)
    finally:
        cp.stop()


async def _over_the_bound(url: str, token: str) -> None:
    lean, plain = _both(url, token, bounded=True)
    big = "x" * (30 << 20)  # over the 7 MiB body bound
    async with lean, plain:
        for _ in range(3):
            a = await _outcome(lambda: lean.create_record("default", "big.md", big))
            b = await _outcome(lambda: plain.create_record("default", "big.md", big))
            assert a == b == ("PermanentError", 413, "too_large", None), (a, b)
        rec = await lean.create_record("default", "small.md", "small\n")
        assert rec.path == "small.md"


_OK = (b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n")


def _record_body(path: str) -> bytes:
    return (b'{"id":"r_1","store":"default","path":"%s","type":"note","size":2,"sha256":"%s",'
            b'"version":1,"created_at":"2026-12-02T00:00:00Z","updated_at":"2026-12-02T00:00:00Z",'
            b'"updated_by":"ws:ws/x","seq":1,"content":null}' % (path.encode(), b"0" * 64))


async def _read_request(stream: trio.SocketStream) -> bool:
    """Read one whole request (headers and a Content-Length body); False at EOF."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = await stream.receive_some(65536)
        if not got:
            return False
        buf += got
    head, _, body = buf.partition(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    while len(body) < n:
        body += await stream.receive_some(65536)
    return True


async def _serve(behaviour: str, nursery: trio.Nursery) -> int:
    """A server on a free port that answers every request as ``behaviour`` says."""
    async def handler(stream: trio.SocketStream) -> None:
        try:
            while await _read_request(stream):
                if behaviour == "silent":
                    await trio.sleep_forever()
                if behaviour == "close":
                    return
                if behaviour == "garbage":
                    await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
                    return
                if behaviour == "slow":  # within the client's timeout
                    await trio.sleep(0.3)
                if behaviour == "mid-answer":  # the head, part of the body, then the close
                    await stream.send_all(_OK % 400 + b'{"id":')
                    return
                if behaviour == "503":
                    body = b'{"type":"about:blank","title":"busy","status":503,"code":"busy"}'
                    await stream.send_all(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\n"
                                          b"Content-Type: application/problem+json\r\n"
                                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    continue
                body = _record_body("a.md")
                await stream.send_all(_OK % len(body) + body)
                if behaviour == "answer-then-close":
                    return
                if behaviour == "answer-then-reset":  # an RST, not a FIN
                    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    return int(listeners[0].socket.getsockname()[1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("behaviour", ["silent", "close", "garbage", "503", "refused", "mid-answer"])
async def test_wire_failures_classified_as_httpx_does(behaviour):
    """Each failure reaches the caller as the same ``ApiError`` (class, status, code,
    ``Retry-After``) through the lean path as through httpx."""
    async with trio.open_nursery() as nursery:
        if behaviour == "refused":
            s = trio.socket.socket()
            await s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()  # nothing listens there
        else:
            port = await _serve(behaviour, nursery)
        lean, plain = _both(f"http://127.0.0.1:{port}", "t", timeout=0.5)
        async with lean, plain:
            a = await _outcome(lambda: lean.create_record("default", "a.md", "x\n"))
            b = await _outcome(lambda: plain.create_record("default", "a.md", "x\n"))
        assert a == b, (a, b)
        assert a[0] == TransientError.__name__
        want = {"silent": "read_timeout", "close": "protocol_error", "garbage": "protocol_error",
                "503": "busy", "refused": "connect_error", "mid-answer": "protocol_error"}[behaviour]
        assert a[2] == want
        if behaviour == "503":
            assert a[3] == 7.0
        nursery.cancel_scope.cancel()


@pytest.mark.timeout(60)
async def test_a_slow_answer_within_the_timeout_is_read_on_a_kept_connection():
    """An answer that comes 0.3 s after its request (the client's timeout 2 s): read, on
    one kept connection, as through httpx."""
    async with trio.open_nursery() as nursery:
        port = await _serve("slow", nursery)
        lean, plain = _both(f"http://127.0.0.1:{port}", "t", timeout=2, bounded=True)
        async with lean, plain:
            for _ in range(3):
                a = await lean.create_record("default", "a.md", "x\n")
                b = await plain.create_record("default", "a.md", "x\n")
                assert a == b and a.path == "a.md"
            assert lean._lean is not None and lean._lean.connections_opened == 1
        nursery.cancel_scope.cancel()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("behaviour", ["answer-then-close", "answer-then-reset"])
async def test_connection_closed_by_the_server_after_an_answer_is_not_reused(behaviour):
    """A server that closes its side after answering (idle keep-alive expiry), or resets
    the connection: the next request opens a new connection instead of failing on the
    dead one."""
    async with trio.open_nursery() as nursery:
        port = await _serve(behaviour, nursery)
        async with ApiClient(f"http://127.0.0.1:{port}", "t", lean=True, timeout=5) as c:
            assert c._lean is not None
            for _ in range(3):
                rec = await c.create_record("default", "a.md", "x\n")
                assert rec.path == "a.md"
                await trio.sleep(0.05)  # the server's FIN arrives
            assert c._lean.connections_opened == 3
        nursery.cancel_scope.cancel()


@pytest.mark.timeout(60)
async def test_a_pooled_connection_closed_while_a_request_goes_out_is_sent_again_once():
    """A server that closes an idle connection as the next request goes out over it (its
    keep-alive expired: it reads the head, answers nothing, closes with the body unread) breaks
    that request's send with no answer: the request never arrived whole, so it is sent once
    more on a new connection instead of failing as ``write_error`` (which the sidecar counted
    as an outage). A send that breaks on a new connection with no answer still fails."""
    seen = {"requests": 0}

    async def handler(stream: trio.SocketStream) -> None:
        try:
            first = True
            while True:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    got = await stream.receive_some(65536)
                    if not got:
                        return
                    buf += got
                seen["requests"] += 1
                if not first:  # a reused connection: closed at once, nothing answered
                    return
                first = False
                head, _, rest = buf.partition(b"\r\n\r\n")
                n = int(next(v for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
                             if k.strip().lower() == b"content-length"))
                while len(rest) < n:
                    rest += await stream.receive_some(65536)
                body = _record_body("a.md")
                await stream.send_all(_OK % len(body) + body)
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        async with ApiClient(f"http://127.0.0.1:{port}", "t", lean=True, timeout=10) as c:
            assert c._lean is not None
            big = "x" * (8 << 20)  # more than the kernel's buffers hold: the send breaks
            for _ in range(3):
                rec = await c.create_record("default", "a.md", big)
                assert rec.path == "a.md"
            # the first on a new connection, then each sent twice: its pooled connection closed
            assert seen["requests"] == 5 and c._lean.connections_opened == 3
        nursery.cancel_scope.cancel()


def test_lean_path_off_with_a_proxy_or_a_transport(monkeypatch):
    """A proxy in the environment (which httpx would use) or a custom transport: httpx."""
    import httpx

    assert ApiClient("http://127.0.0.1:1", "t", lean=True)._lean is not None
    assert ApiClient("http://127.0.0.1:1", "t", lean=True,
                     transport=httpx.MockTransport(lambda r: httpx.Response(200)))._lean is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert ApiClient("http://127.0.0.1:1", "t", lean=True)._lean is None


async def _serve_drip(nursery: trio.Nursery, head_delay: float = 0.0) -> int:
    """A server that sends each answer's head at once (after ``head_delay`` s) and then its
    body a byte every 0.1 s: each read gets something, so no per-read timeout ever fires."""
    body = b'{"records": [], "seq": 0, "more": false}' + b" " * 400

    async def handle(stream: trio.SocketStream) -> None:
        try:
            got = b""
            while b"\r\n\r\n" not in got:
                data = await stream.receive_some(65536)
                if not data:
                    return
                got += data
            await trio.sleep(head_delay)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                  b"content-length: %d\r\n\r\n" % len(body))
            for i in range(len(body)):
                await stream.send_all(body[i:i + 1])
                await trio.sleep(0.1)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    return listeners[0].socket.getsockname()[1]


@pytest.mark.timeout(60)
async def test_a_dripping_answer_is_cut_at_the_request_deadline():
    """An answer that arrives a byte at a time (docs/SEMANTICS.md, "Started while the
    control plane is unreachable or too slow"): a bounded client's request fails as a read
    timeout once the answer is ``timeout`` s past its head without the body at 64 KiB/s,
    on the lean path and on the httpx one (a request with query parameters), instead of
    taking as long as the drip lasts (45 s here); an unbounded httpx client keeps reading."""
    async with trio.open_nursery() as nursery:
        port = await _serve_drip(nursery)
        url = f"http://127.0.0.1:{port}"
        async with ApiClient(url, "t", lean=True, bounded=True, timeout=1) as c:
            assert c._lean is not None
            for call in (lambda: c.list_attachments("ws"),  # lean: no query parameters
                         lambda: c.changes("default", 0, wait=0)):  # httpx, bounded
                t0 = trio.current_time()
                with pytest.raises(TransientError) as err:
                    await call()
                took = trio.current_time() - t0
                assert err.value.code == "read_timeout", err.value
                assert 0.9 < took < 15, took  # 1 s, where the drip lasts 45 s
        async with ApiClient(url, "t", timeout=1) as plain:  # per-read timeouts only
            with trio.move_on_after(3) as scope:
                await plain.changes("default", 0, wait=0)
            assert scope.cancelled_caught  # still reading after 3 s
        nursery.cancel_scope.cancel()


@pytest.mark.timeout(60)
async def test_a_dripping_stream_line_is_cut_at_its_deadline():
    """A change stream whose line arrives a byte every 0.1 s: a bounded client's stream
    fails as a read timeout about ``read_timeout`` s after it waited for the line (the feed
    then reopens it), where per-read timeouts alone would keep it waiting as long as the
    drip lasts."""
    line = b'{"changes": [], "seq": 1, "more": false}' + b" " * 400 + b"\n"

    async def handle(stream: trio.SocketStream) -> None:
        try:
            got = b""
            while b"\r\n\r\n" not in got:
                data = await stream.receive_some(65536)
                if not data:
                    return
                got += data
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                                  b"connection: close\r\n\r\n")
            for i in range(len(line)):
                await stream.send_all(line[i:i + 1])
                await trio.sleep(0.1)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handle, 0)
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with ApiClient(url, "t", lean=True, bounded=True, timeout=1) as c:
            stream = c.changes_stream("default", 0, read_timeout=1)
            t0 = trio.current_time()
            with pytest.raises(TransientError) as err:
                async for _page in stream:
                    pass
            took = trio.current_time() - t0
            await stream.aclose()
            assert err.value.code == "read_timeout", err.value
            assert 0.9 < took < 15, took  # 1 s, where the line's drip lasts 44 s
        async with ApiClient(url, "t", timeout=1) as plain:  # per-read timeouts only
            stream = plain.changes_stream("default", 0, read_timeout=1)
            with trio.move_on_after(3) as scope:
                async for _page in stream:
                    pass
            await stream.aclose()
            assert scope.cancelled_caught  # still reading after 3 s
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- answers read without h11

_BODY = b'{"ok":true}'
_ANSWERS = {
    # read without h11 (LeanHTTP._receive), the connection reused
    "plain": b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + _BODY,
    "no-reason": b"HTTP/1.1 200 \r\ncontent-length: 11\r\n\r\n" + _BODY,
    "empty-body": b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nX-A:  spaced  \r\n\r\n",
    "close": b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 11\r\n\r\n" + _BODY,
    # left to h11 with what was read (LeanHTTP._receive_h11), the connection not reused
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"ok\"\r\n6\r\n:true}\r\n0\r\n\r\n",
    "bare-lf": b"HTTP/1.1 200 OK\nContent-Length: 11\n\n" + _BODY,
    "two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nContent-Length: 11\r\n\r\n" + _BODY,
    "204": b"HTTP/1.1 204 No Content\r\nContent-Length: 11\r\n\r\n",
    "continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n" + _BODY,
    "folded": b"HTTP/1.1 200 OK\r\nX-Long: a\r\n  b\r\nContent-Length: 11\r\n\r\n" + _BODY,
    "http-1.0": b"HTTP/1.0 200 OK\r\nContent-Length: 11\r\n\r\n" + _BODY,
    "trailing": b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n" + _BODY + b"HTTP/1.1 200 OK\r\n",
    "until-eof": b"HTTP/1.1 200 OK\r\n\r\n" + _BODY,
}
_REUSED = {"plain", "no-reason", "empty-body"}


def _h11_reads(raw: bytes) -> tuple[Any, ...]:
    """What h11 itself reads from ``raw`` as the answer to a POST: (status, reason,
    headers, body)."""
    import h11

    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/x", headers=[("Host", "h"), ("Content-Length", "1")]))
    conn.send(h11.Data(data=b"x"))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")  # what the server sent, then its close
    out: list[Any] = []
    body = b""
    while True:
        ev = conn.next_event()
        if isinstance(ev, h11.Response):
            out = [ev.status_code, ev.reason, list(ev.headers)]
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif isinstance(ev, h11.EndOfMessage):
            return (*out, body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", sorted(_ANSWERS))
@pytest.mark.parametrize("pieces", [1, 3, 1000])
async def test_answers_read_as_h11_reads_them(form, pieces):
    """Every answer reads as h11 reads it (status, reason, headers, body), whether it
    arrives at once or in pieces; a connection is kept only after a plain keep-alive answer
    (each answer here is followed by the server's close, as h11 is told above: an answer
    framed by the close is then whole)."""
    from memfuse.client.lean import LeanHTTP

    if form == "trailing" and pieces > 1:
        pytest.skip("bytes after a whole answer are seen only when they come with it (as "
                    "when h11 read every answer): later, they meet the next request")
    raw = _ANSWERS[form]
    cut = [raw[i * len(raw) // pieces:(i + 1) * len(raw) // pieces] for i in range(pieces)]

    async def handler(stream: trio.SocketStream) -> None:
        try:
            while await _read_request(stream):
                for part in cut:
                    if part:
                        await stream.send_all(part)
                        await trio.sleep(0.001 if pieces > 1 else 0)
                if form not in _REUSED:
                    return
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        lean = LeanHTTP(f"http://127.0.0.1:{port}", None, 5.0)
        try:
            for _ in range(2):
                a = await lean.exchange("POST", "/x", [("Content-Type", "text/plain")], b"x")
                assert (a.status, a.reason, a.headers, a.content) == _h11_reads(raw), form
                r = a.response()  # the httpx view of it, as LeanHTTP.send returns it
                assert (r.status_code, r.content) == (a.status, a.content)
        finally:
            await lean.aclose()
        assert lean.connections_opened == (1 if form in _REUSED else 2), form
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- header lines as h11 reads them

_LINE_BYTES = b"aZ09-!~:;, \t\"\x00\x01\x0b\x0c\r\n\x7f\x80\xff("


def _h11_head(raw: bytes) -> tuple[Any, ...] | None:
    """``_h11_reads`` of ``raw`` (an answer to a POST), None when h11 refuses it."""
    import h11

    try:
        return _h11_reads(raw)
    except h11.RemoteProtocolError:
        return None


@pytest.mark.timeout(120)
@given(lines=st.lists(st.binary(min_size=1, max_size=12).map(
    lambda b: bytes(_LINE_BYTES[x % len(_LINE_BYTES)] for x in b)), max_size=4))
@hyp_settings(400)
def test_header_lines_read_as_h11_reads_them(lines):
    """An answer head read without h11 (``lean._simple_head``: header lines checked by
    ``_TOKEN`` / ``_FIELD``, not by h11's expression) is exactly what h11 reads from it
    (status, reason, the headers' names and values, the body), for header lines made of
    the bytes that matter to h11's grammar (token and field bytes, ``:``, blanks, NUL, VT,
    FF, CR, LF, DEL, obs-text); whatever it does not read, h11 is handed. And the plain
    form is read here, not handed on: a head h11 reads whose lines hold neither CR nor LF
    (nor a second ``Content-Length`` or a ``Transfer-Encoding``, nor a folded line) is
    read without h11."""
    from memfuse.client.lean import _simple_head

    raw = (b"HTTP/1.1 200 OK\r\n" + b"".join(ln + b"\r\n" for ln in lines)
           + b"Content-Length: 2\r\n\r\nok")
    head = _simple_head(raw, "POST")
    assert head is not None  # the head is whole
    h11_read = _h11_head(raw)
    if head is False:
        plain = all(b"\r" not in ln and b"\n" not in ln and not ln[:1].isspace() for ln in lines)
        names = [ln.partition(b":")[0].strip().lower() for ln in lines]
        framing = b"content-length" in names or b"transfer-encoding" in names
        assert h11_read is None or not plain or framing, (raw, h11_read)
        return
    assert h11_read is not None, raw
    status, reason, headers, start, size, _ = head
    assert (status, reason, headers, raw[start:start + size]) == h11_read, raw
    assert start + size == len(raw)


@pytest.mark.timeout(60)
async def test_an_exchange_on_a_kept_connection_waits_once(monkeypatch):
    """A request on a kept connection whose answer comes whole costs the trio thread one
    scheduler pass: the one that waits for the answer. Neither the send (taken by the
    kernel at once) nor a read attempted before the answer can be there makes one (trio's
    ``SocketStream`` yields after every send: two passes per commit request, each ~20 us
    of the sidecar's CPU). Nor does it enter a trio cancel scope (~58 k instructions, ~10 us):
    its deadline is kept by the run's timer keeper (``lean._Bound``; one scope per request
    before session 16)."""
    from memfuse.client.lean import LeanHTTP

    scopes = 0
    enter = trio.CancelScope.__enter__

    def counting(self: trio.CancelScope) -> trio.CancelScope:
        nonlocal scopes
        scopes += 1
        return enter(self)

    class Passes(trio.abc.Instrument):
        def __init__(self) -> None:
            self.waits = 0

        def before_io_wait(self, timeout: float) -> None:
            self.waits += 1

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]

    def serve() -> None:  # in a thread: this trio run has only the client's passes
        conn, _ = listener.accept()
        conn.settimeout(10)
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf or len(buf.partition(b"\r\n\r\n")[2]) < 2:
                    got = conn.recv(65536)
                    if not got:
                        return
                    buf += got
                buf = buf.partition(b"\r\n\r\n")[2][2:]  # each request's body is b"{}"
                body = _record_body("a.md")
                conn.sendall(_OK % len(body) + body)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        lean = LeanHTTP(f"http://127.0.0.1:{port}", None, 5.0)
        passes = Passes()
        try:
            await lean.exchange("POST", "/x", [("Content-Type", "application/json")], b"{}")
            counts = []
            entered = []
            for _ in range(5):
                trio.lowlevel.add_instrument(passes)
                passes.waits = scopes = 0
                monkeypatch.setattr(trio.CancelScope, "__enter__", counting)
                a = await lean.exchange("POST", "/x", [("Content-Type", "application/json")], b"{}")
                monkeypatch.setattr(trio.CancelScope, "__enter__", enter)
                trio.lowlevel.remove_instrument(passes)
                assert a.status == 201
                counts.append(passes.waits)
                entered.append(scopes)
        finally:
            await lean.aclose()
        assert lean.connections_opened == 1
        assert counts == [1] * 5, counts
        assert entered == [0] * 5, entered
    finally:
        listener.close()
        server.join(timeout=10)


@pytest.mark.timeout(60)
async def test_tls_answers_on_a_kept_connection_and_a_new_one_after_a_close(tmp_path):
    """Over TLS (``https://``, the client's context trusting the server's self-signed
    certificate) the lean path reads answers on one kept connection, and opens a new one
    once the server closed the kept one; a certificate the context does not trust is a
    connect error."""
    import ssl
    import subprocess

    from memfuse.client.lean import LeanHTTP

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(str(cert), str(key))
    answers = {"n": 0}

    async def handler(stream: trio.SSLStream) -> None:
        try:
            while await _read_request(stream):  # type: ignore[arg-type]
                answers["n"] += 1
                body = _record_body("a.md")
                await stream.send_all(_OK % len(body) + body)
                if answers["n"] == 3:  # then the server closes this connection
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_ssl_over_tcp_listeners(0, server, host="127.0.0.1")
        port = listeners[0].transport_listener.socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        lean = LeanHTTP(f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=str(cert)), 5.0)
        try:
            for i in range(5):
                a = await lean.exchange("POST", "/x", [("Content-Type", "application/json")], b"{}")
                assert a.status == 201 and a.content == _record_body("a.md"), i
                if i == 2:
                    await trio.sleep(0.1)  # the server's close arrives
        finally:
            await lean.aclose()
        assert lean.connections_opened == 2
        untrusting = LeanHTTP(f"https://127.0.0.1:{port}", ssl.create_default_context(), 5.0)
        with pytest.raises(httpx.ConnectError):
            await untrusting.exchange("POST", "/x", [], b"{}")
        await untrusting.aclose()
        nursery.cancel_scope.cancel()


def test_a_stores_commit_requests_check_their_request_line_and_hex_keys_once(monkeypatch):
    """Every create of a store is ``POST`` to one target with a 32-hex idempotency key: the
    request line is checked by h11's expressions once and kept (``lean._REQUEST_LINES``),
    a key of letters and digits is a field value without h11's expression; anything else is
    checked as before, and an illegal target is refused every time (bench/README.md, "The
    close path, session 20: sidecar")."""
    import h11

    from memfuse.client import lean
    from memfuse.sidecar.journal import new_key

    calls = {"method": 0, "target": 0, "value": 0}

    class Counting:
        def __init__(self, name: str, pattern: Any) -> None:
            self.name, self.pattern = name, pattern

        def fullmatch(self, s: bytes) -> Any:
            calls[self.name] += 1
            return self.pattern.fullmatch(s)

    monkeypatch.setattr(lean, "_METHOD_RE", Counting("method", lean._METHOD_RE))
    monkeypatch.setattr(lean, "_TARGET_RE", Counting("target", lean._TARGET_RE))
    monkeypatch.setattr(lean, "_VALUE_RE", Counting("value", lean._VALUE_RE))
    monkeypatch.setattr(lean, "_REQUEST_LINES", {})
    for _ in range(50):
        head = lean._request_head("POST", "/v1/stores/notes/records", b"Host: x\r\n")
        assert head == b"POST /v1/stores/notes/records HTTP/1.1\r\nHost: x\r\n\r\n"
        key = new_key()
        assert lean._varying_items([("Idempotency-Key", key), ("Content-Length", "550")]) == [
            (b"Idempotency-Key", b"idempotency-key", key.encode()),
            (b"Content-Length", b"content-length", b"550")]
    assert calls == {"method": 1, "target": 1, "value": 0}
    for _ in range(2):
        with pytest.raises(h11.LocalProtocolError):
            lean._request_head("POST", "/a b", b"")
    assert calls["target"] == 3
    assert lean._varying_items([("If-Match", '"abc"')])[0][2] == b'"abc"'
    assert calls["value"] == 1
    # a value h11 refuses still goes to h11's own validation (LocalProtocolError)
    with pytest.raises(h11.LocalProtocolError):
        lean._varying_items([("Idempotency-Key", " k")])
