"""``memfuse dev``'s console server (``devenv.ConsoleServer``) when its port is taken between
the look and the bind (two ``memfuse dev`` started at the same moment, harness19): with
``fallback`` it serves on a free port of the same host instead; without, the bind's
``OSError`` (``EADDRINUSE``) is raised."""
from __future__ import annotations

import errno
import socket

import httpx
import pytest

from memfuse.devenv import ConsoleServer
from memfuse.server.app import create_app


def _taken() -> tuple[socket.socket, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("fallback", [True, False])
def test_port_taken_after_the_look_falls_back_to_a_free_port(tmp_path, monkeypatch, fallback):
    holder, listen = _taken()
    # the look found the port free; another process bound it before our bind
    monkeypatch.setattr(ConsoleServer, "_address", lambda self: self.listen)
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={"adm-token-console": None})
    srv = ConsoleServer(app, listen, fallback=fallback)
    try:
        if not fallback:
            with pytest.raises(OSError) as e:
                srv.start()
            assert e.value.errno == errno.EADDRINUSE
            return
        url = srv.start()
        assert url.startswith("http://127.0.0.1:") and not url.endswith(listen.rpartition(":")[2])
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
    finally:
        srv.stop()
        holder.close()
