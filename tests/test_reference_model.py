"""A reference model of the sidecar's core (mountpoint-s3's ``reftests``, here with Hypothesis).

A ``RuleBasedStateMachine`` drives the filesystem core without FUSE (``core.Filesystem``) with
its committer and the in-process fake control plane (``memfuse/fake.py``, real HTTP semantics
through ``httpx.ASGITransport``), and compares it with a dict model (path -> bytes) after every
step, once the state has settled (the outbox drained, the change feed applied):

- local operations: create / overwrite, append (``O_APPEND``), rename, rename over an existing
  file, unlink, mkdir — as a program on the mount does them (open, write, close);
- remote edits by another workspace's client through the fake (create, overwrite, delete),
  brought in by the change feed (``Filesystem.apply_remote``, as ``StoreSync`` does);
- an append that races a remote overwrite (the commit held until the remote edit landed): the
  conflict protocol rebases it onto the remote content (``conflict.ConflictResolver``), so the
  model expects the remote content plus the appended bytes.

After each step the local tree, the control plane's live records and the model must agree, and
``check_invariants`` must hold. The core runs under trio in a thread of its own (one per
example); rules call into it through ``trio.from_thread``. Examples are bounded (a few dozen
steps each) so the module runs in well under a minute on a quiet machine.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from tempfile import TemporaryDirectory

import trio
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem, Settings
from memfuse.sidecar.journal import Journal

STORE = "default"
FILES = ["a.md", "b.md", "d/c.md", "d/e.md"]
DIRS = ["d"]
TEXT = st.text(alphabet="abcxyz \n", min_size=0, max_size=24).map(lambda s: s.encode())
SETTLE_S = 30.0  # bound of one settle (outbox drained, feed applied)
pytestmark = pytest.mark.timeout(300)


class Core:
    """A filesystem core, its committer and the fake control plane, run by ``trio.run`` in a
    thread of its own; ``call(afn, *args)`` runs ``afn`` there and returns its result."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the core did not start within 60 s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # reported to the constructor or at close
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self.fake = FakeControlPlane(seed=0)
        token = await self.fake.setup("ws", stores=(STORE,))
        other = await self.fake.setup("other", stores=(STORE,))
        self.client = ApiClient(self.fake.base_url, token, transport=self.fake.transport,
                                instance="model")
        self.other = ApiClient(self.fake.base_url, other, transport=self.fake.transport,
                               instance="other")
        self.journal = Journal(self.tmp / "outbox.db")
        self.fs = Filesystem(BlobCache(self.tmp / "blobs.db"), self.client, self.journal,
                             Settings(commit_wait=10), "ws")
        self.committer = self.fs.committer
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.journal.run)
            await nursery.start(self.committer.run)
            self.sm = self.fs.add_store(STORE, "read_write", [])
            self.cursor = (await self.client.changes(STORE, 0)).seq
            self.token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        await self.client.aclose()
        await self.other.aclose()
        self.journal.close()
        self.fs.blobs.close()
        await self.fake.aclose()

    def call(self, afn, *args):
        return trio.from_thread.run(afn, *args, trio_token=self.token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(30)
        if self._error is not None:
            raise self._error

    # --- run on the core's trio thread --------------------------------------------------------
    def _dir(self, path: str):
        """The directory that holds ``path``, made where missing (``mkdir -p``)."""
        d = self.sm.root
        for comp in path.split("/")[:-1]:
            c = d.children.get(comp)
            if c is None:
                c = self.fs.mkdir(d.ino, comp.encode(), 0o755, 0, 0)
            d = c
        return d

    async def write(self, path: str, data: bytes, append: bool = False) -> None:
        """open(2) (O_CREAT | O_TRUNC, or O_APPEND), write(2), close(2), as a shell does."""
        d = self._dir(path)
        name = path.rsplit("/", 1)[-1]
        n = d.children.get(name)
        if n is None:
            h = self.fs.create(d.ino, name.encode(), 0o644, os.O_WRONLY, 0, 0)
        else:
            h = self.fs.open(n.ino, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
        off = h.node.cur_size() if append else 0
        if data:
            self.fs.write(h, off, data)
        await self.fs.flush(h)
        self.fs.release(h.fh)

    async def rename(self, src: str, dst: str) -> None:
        self.fs.rename(self._dir(src).ino, src.rsplit("/", 1)[-1].encode(),
                       self._dir(dst).ino, dst.rsplit("/", 1)[-1].encode(), 0)

    async def unlink(self, path: str) -> None:
        self.fs.unlink(self._dir(path).ino, path.rsplit("/", 1)[-1].encode())

    async def mkdir(self, path: str) -> None:
        if path not in self.sm.root.children:
            self.fs.mkdir(self.sm.root.ino, path.encode(), 0o755, 0, 0)

    async def remote_write(self, path: str, data: bytes) -> None:
        """Another workspace writes ``path`` (unconditionally: create or new version)."""
        found = await self.other.find_record(STORE, path)
        if found is None:
            await self.other.create_record(STORE, path, data.decode())
        else:
            await self.other.update_record(STORE, found.id, data.decode())

    async def remote_delete(self, path: str) -> None:
        found = await self.other.find_record(STORE, path)
        if found is not None:
            await self.other.delete_record(STORE, found.id)

    async def append_racing_remote(self, path: str, suffix: bytes, theirs: bytes) -> None:
        """Append ``suffix`` locally while the commit is held, and let another workspace
        overwrite the file with ``theirs`` before the append is sent (its If-Match fails)."""
        async with self.committer.hold(STORE):
            d = self._dir(path)
            n = d.children[path.rsplit("/", 1)[-1]]
            h = self.fs.open(n.ino, os.O_WRONLY | os.O_APPEND)
            self.fs.write(h, n.cur_size(), suffix)
            e = self.fs.commit(n)
            self.fs.release(h.fh)
            assert e is not None
            await e.wait_accepted(10)
            await self.remote_write(path, theirs)

    async def settle(self) -> None:
        """Every local change committed, then the change feed applied, as ``StoreSync`` does
        (the outbox empty first; our own versions come back and are skipped by version)."""
        with trio.fail_after(SETTLE_S):
            await self.committer.wait_idle()
            while True:
                page = await self.client.changes(STORE, self.cursor)
                if not page.changes:
                    break
                await self.committer.wait_store_idle(STORE)
                for ch in page.changes:
                    self.fs.apply_remote(self.sm, ch.record)
                self.cursor = page.seq

    async def local_tree(self) -> dict[str, bytes]:
        return {n.path(): self.fs._content(n) for n in self.fs._walk_files(self.sm.root)
                if not n.local_only}

    async def remote_tree(self) -> dict[str, bytes]:
        out = {}
        async for page in self.client.iter_pages(STORE):
            for r in page.records:
                out[r.path] = (r.content or "").encode()
        return out

    async def check(self) -> None:
        self.fs.check_invariants()


class ReferenceModel(RuleBasedStateMachine):
    """The core against ``self.model`` (path -> bytes of every live file)."""

    def __init__(self) -> None:
        super().__init__()
        self._tmp = TemporaryDirectory(prefix="memfuse-refmodel-")
        self.core = Core(Path(self._tmp.name))
        self.model: dict[str, bytes] = {}

    def teardown(self) -> None:
        try:
            self.core.close()
        finally:
            self._tmp.cleanup()

    def _settled(self) -> None:
        self.core.call(self.core.settle)

    # --- local operations ------------------------------------------------------------------------
    @rule(path=st.sampled_from(FILES), data=TEXT)
    def write(self, path: str, data: bytes) -> None:
        self.core.call(self.core.write, path, data)
        self.model[path] = data
        self._settled()

    @precondition(lambda self: self.model)
    @rule(pick=st.data(), suffix=TEXT)
    def append(self, pick, suffix: bytes) -> None:
        path = pick.draw(st.sampled_from(sorted(self.model)))
        self.core.call(self.core.write, path, suffix, True)
        self.model[path] += suffix
        self._settled()

    @precondition(lambda self: self.model)
    @rule(pick=st.data(), dst=st.sampled_from(FILES))
    def rename(self, pick, dst: str) -> None:
        """rename(2) to a free name, or over an existing file (it takes over its record)."""
        src = pick.draw(st.sampled_from(sorted(self.model)))
        if src == dst:
            return
        self.core.call(self.core.rename, src, dst)
        self.model[dst] = self.model.pop(src)
        self._settled()

    @precondition(lambda self: self.model)
    @rule(pick=st.data())
    def unlink(self, pick) -> None:
        path = pick.draw(st.sampled_from(sorted(self.model)))
        self.core.call(self.core.unlink, path)
        del self.model[path]
        self._settled()

    @rule(path=st.sampled_from(DIRS))
    def mkdir(self, path: str) -> None:
        self.core.call(self.core.mkdir, path)  # an empty directory: no record, not in the model
        self._settled()

    # --- edits by another client -----------------------------------------------------------------
    @rule(path=st.sampled_from(FILES), data=TEXT)
    def remote_write(self, path: str, data: bytes) -> None:
        self.core.call(self.core.remote_write, path, data)
        self.model[path] = data
        self._settled()

    @precondition(lambda self: self.model)
    @rule(pick=st.data())
    def remote_delete(self, pick) -> None:
        path = pick.draw(st.sampled_from(sorted(self.model)))
        self.core.call(self.core.remote_delete, path)
        del self.model[path]
        self._settled()

    @precondition(lambda self: self.model)
    @rule(pick=st.data(), suffix=TEXT.filter(bool), theirs=TEXT)
    def append_racing_remote(self, pick, suffix: bytes, theirs: bytes) -> None:
        """The conflict protocol: an append that met a concurrent overwrite is rebased onto
        it (the remote content plus the appended bytes), nothing is lost."""
        path = pick.draw(st.sampled_from(sorted(self.model)))
        if theirs in (self.model[path], self.model[path] + suffix):
            return  # no concurrent change then, or the very content this write makes
        self.core.call(self.core.append_racing_remote, path, suffix, theirs)
        self.model[path] = theirs + suffix
        self._settled()

    # --- after every step ----------------------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self) -> None:
        self.core.call(self.core.check)
        local = self.core.call(self.core.local_tree)
        assert local == self.model, f"local tree {local} != model {self.model}"
        remote = self.core.call(self.core.remote_tree)
        assert remote == self.model, f"control plane {remote} != model {self.model}"


ReferenceModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("MEMFUSE_REFMODEL_EXAMPLES", "12")),
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # no shrinking: each run starts a core and a control plane (~0.5 s), so shrinking a
    # failure would take minutes; the failing program of up to 20 steps is printed as found
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
TestReferenceModel = ReferenceModel.TestCase
