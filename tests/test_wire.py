"""The client's msgspec Structs (memfuse.wire) agree with the server's pydantic models
(memfuse.models): same names, fields, optionality and defaults; JSON the server produces
decodes in the Struct and, encoded again, validates equal in the server model; request bodies
are byte for byte what the pydantic model gives (the idempotency hash of a retried request
must not change across releases); constraints refuse what the server refuses."""
from __future__ import annotations

import inspect
from datetime import datetime, timedelta, timezone

import httpx
import msgspec
import pytest
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from memfuse import models, wire
from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane

# Server models the client never decodes or encodes as such: StoreLimits is documentation
# only; MemoryToolCommand's body is the model's tool input passed through as a dict.
SERVER_ONLY = {"StoreLimits", "MemoryToolCommand"}

T1 = datetime(2026, 12, 1, 4, 24, 7, 123456, tzinfo=timezone.utc)
T2 = datetime(2027, 1, 2, 3, 4, 5, tzinfo=timezone.utc)

RECORD_FULL = dict(id="r-1", store="default", path="notes/ü ß.md", type="project", version=3,
                   sha256="ab" * 32, size=12, deleted=True, created_at=T1, updated_at=T2,
                   updated_by="ws:w/side-1", seq=41, content="line \"one\"\n\u2028\x01", mode=0o4755,
                   mtime_ns=-1_577_923_200_123_456_789, review_after=T1, expires_at=T2)
RECORD_MIN = dict(id="r-2", store="s", path="MEMORY.md", type=None, version=1, sha256="00" * 32,
                  size=0, created_at=T1, updated_at=T1, updated_by="admin", seq=1)
STORE_FULL = dict(slug="s.1", description="d", default_type="user", max_record_bytes=5,
                  max_store_bytes=6, max_records=7, created_at=T1, usage_bytes=9, record_count=2,
                  account="acme")
STORE_MIN = {k: v for k, v in STORE_FULL.items() if k not in ("usage_bytes", "record_count", "account")}
VERSION_FULL = dict(record_id="r-1", version=2, operation="moved", path="a.md", type="user",
                    sha256="cd" * 32, size=3, created_at=T1, actor="ws:w/x", redacted=True, seq=7,
                    content="abc", mode=0o600, mtime_ns=5)
VERSION_MIN = dict(record_id="r-1", version=1, operation="created", path="a.md", type=None,
                   sha256="cd" * 32, size=3, created_at=T2, actor="admin", seq=1)

# name → examples: every optional member set (not to its default), and only the required ones
EXAMPLES: dict[str, list[dict]] = {
    "WorkspaceCreate": [dict(name="w-1", default_store=False), dict(name="w")],
    "Workspace": [dict(name="w", created_at=T1, account="acme"), dict(name="w", created_at=T1)],
    "AccountCreate": [dict(slug="acme", max_stores=1, max_bytes=2, max_tokens=0), dict(slug="a")],
    "AccountUpdate": [dict(max_stores=1, max_bytes=None, max_tokens=0), dict()],
    "AccountAttachment": [dict(store="user", access="read_only", created_at=T1)],
    "Account": [dict(slug="acme", created_at=T1, max_stores=1, max_bytes=2, max_tokens=3, stores=1,
                     bytes=9, tokens=2, attachments=[dict(store="user", access="read_only", created_at=T1)]),
                dict(slug="default", created_at=T2)],
    "StoreCreate": [dict(slug="s", description="d", default_type="user", max_record_bytes=1,
                         max_store_bytes=2, max_records=3), dict(slug="s")],
    "StoreUpdate": [dict(description="d", default_type="reference", max_record_bytes=1,
                         max_store_bytes=2, max_records=3), dict(), dict(max_records=4)],
    "Store": [STORE_FULL, STORE_MIN],
    "AttachmentPut": [dict(access="read_only", instructions="only facts"), dict()],
    "Attachment": [dict(workspace="w", store=STORE_FULL, access="read_only", instructions="i",
                        created_at=T2),
                   dict(workspace="w", store=STORE_MIN, access="read_write", instructions="",
                        created_at=T1)],
    "TokenCreate": [dict(workspace="w", name="n", ttl_seconds=60, account="acme"), dict(), dict(workspace="w")],
    "TokenCreated": [dict(id="t", workspace="w", name="n", token="mf_x", expires_at=T2, account="acme"),
                     dict(id="t", workspace=None, name="", token="mf_x")],
    "TokenInfo": [dict(id="t", workspace="w", name="n", created_at=T1, last_used_at=T2,
                       expires_at=T2, revoked_at=T2, state="revoked", account="acme"),
                  dict(id="t", workspace=None, name="", created_at=T1)],
    "RecordCreate": [dict(path="a.md", content="x\n", type="user", mode=0o600, mtime_ns=-3),
                     dict(path="a.md", content=""), dict(path="a.md", content="x", type=None)],
    "RecordUpdate": [dict(content="x", type="feedback", mode=0, mtime_ns=models.MTIME_NS_MAX),
                     dict(content="x"), dict(content="x", overwrite=True),
                     dict(content="x", overwrite=True, overwrite_base="ab" * 32)],
    "RecordAppend": [dict(append="x\n", type="feedback", mode=0, mtime_ns=models.MTIME_NS_MAX),
                     dict(append="")],
    "RecordAttributes": [dict(mode=0o777, mtime_ns=models.MTIME_NS_MIN), dict(),
                         dict(mode=None, mtime_ns=None)],
    "RecordMove": [dict(path="b.md", replace=True), dict(path="b.md")],
    "PrefixMove": [dict(from_prefix="a", to_prefix="b")],
    "Restore": [dict(version=2)],
    "Record": [RECORD_FULL, RECORD_MIN],
    "Version": [VERSION_FULL, VERSION_MIN],
    "RecordPage": [dict(records=[RECORD_FULL, RECORD_MIN], next_cursor="c1", seq=5),
                   dict(records=[], seq=0)],
    "MoveResult": [dict(records=[RECORD_MIN, RECORD_FULL]), dict(records=[])],
    "Change": [dict(seq=3, operation="moved", old_path="z.md", record=RECORD_FULL),
               dict(seq=3, operation="created", record=RECORD_MIN),
               dict(seq=4, operation="modified", record=RECORD_FULL,
                    overwrote=dict(version=2, actor="ws:wb/i1"))],
    "Overwritten": [dict(version=2, actor="ws:wb/i1"),
                    dict(version=5, actor="ws:wa/i1", also=[dict(version=4, actor="ws:wb/i1")])],
    "ChangePage": [dict(changes=[dict(seq=3, operation="deleted", old_path=None, record=RECORD_FULL)],
                        seq=9), dict(changes=[], seq=0)],
    "WorkspaceEvent": [dict(seq=1, kind="attached", store="s", access="read_only"),
                       dict(seq=2, kind="detached", store="s")],
    "EventPage": [dict(events=[dict(seq=1, kind="store_changed", store="s", access=None)], seq=1),
                  dict(events=[], seq=0)],
    "MemoryToolResult": [dict(content="ok", is_error=True), dict(content="")],
    "SearchLine": [dict(line=3, text="tea \u2028 <b>x</b> …")],
    "SearchHit": [dict(record=RECORD_MIN, path_match=True, lines=[dict(line=1, text="a")],
                       line_matches=4), dict(record=RECORD_FULL),
                  dict(record=RECORD_MIN, score=1.25, snippet="a   snippet …")],
    "SearchPage": [dict(hits=[dict(record=RECORD_MIN, lines=[dict(line=2, text="")], line_matches=1)],
                        next_cursor="c", seq=3), dict(hits=[], seq=0)],
    "StaleRecord": [dict(path="a", updated_at=T1, review_after=T1, expires_at=T2), dict(path="b", updated_at=T1)],
    "IndexEntry": [dict(line=3, text="- [A](a.md) \u202e", target="a.md")],
    "IndexReport": [dict(store="s", index_exists=True, entries=3, missing=[dict(line=1, text="x", target="b.md")],
                         unindexed=["c.md"], unindexed_count=4, omitted=[dict(line=201, text="y", target="d")],
                         lines=300, lines_shown=200, bytes=9000, bytes_shown=6000,
                         stale=[dict(path="a.md", updated_at=T1, review_after=T2, expires_at=None),
                                dict(path="b.md", updated_at=T2)], stale_count=7, stale_after_days=90),
                    dict(store="s", index_exists=False)],
    "BatchOperation": [dict(op="update", record_id="r", if_match='"ab"', idempotency_key="k",
                            body={"content": "x", "type": None, "mode": 0o600}),
                       dict(op="append", record_id="r", if_match='"ab"', idempotency_key="k-append",
                            body={"append": "x\n", "type": None}),
                       dict(op="delete")],
    "BatchRequest": [dict(operations=[dict(op="create", idempotency_key="k1",
                                           body={"path": "a", "content": "", "type": None}),
                                      dict(op="delete", record_id="r")]), dict(operations=[])],
    "BatchResult": [dict(status=201, body={"id": "r", "nested": {"x": None}}, etag='"ab"', replayed=True),
                    dict(status=204)],
    "BatchResponse": [dict(results=[dict(status=412, body={"title": "t", "status": 412}),
                                    dict(status=204)]), dict(results=[])],
    "ConsolidationCreate": [dict(instructions="merge", output="in_place", model="m", include_history=True),
                            dict(instructions="x")],
    "ConsolidationUsage": [dict(input_tokens=5, output_tokens=6), dict()],
    "ConsolidationChange": [dict(op="delete", path="a.md")],
    "ConsolidationJob": [dict(id="j", store="s", status="completed", output="new_store",
                              output_store="s-consolidated-1", model="m", instructions="i", include_history=True,
                              requested_by="ws:w/api", scheduled=True, created_at=T1, started_at=T1,
                              finished_at=T2, input_seq=9, usage=dict(input_tokens=1, output_tokens=2),
                              summary="s", changes=[dict(op="write", path="a.md")], error="e"),
                         dict(id="j", store="s", status="pending", output="in_place", model="m", instructions="i",
                              requested_by="admin:static", created_at=T1)],
    "Problem": [dict(type="https://example.invalid/p", title="t", status=409, detail="d", code="c"),
                dict(title="t", status=500)],
}

# request bodies: the client builds and sends them (wire.build + wire.encode)
REQUESTS = {"WorkspaceCreate", "AccountCreate", "AccountUpdate", "StoreCreate", "StoreUpdate", "AttachmentPut", "TokenCreate",
            "RecordCreate", "RecordUpdate", "RecordAppend", "RecordAttributes", "RecordMove", "PrefixMove", "Restore",
            "BatchOperation", "BatchRequest", "ConsolidationCreate"}
# the pydantic options the client sent each with (earlier releases): the same bytes now
DUMP_OPTIONS = {"StoreUpdate": dict(exclude_none=True), "AccountUpdate": dict(exclude_unset=True), "BatchOperation": dict(exclude_none=True),
                "BatchRequest": dict(exclude_none=True), "RecordCreate": dict(exclude_unset=True),
                "RecordUpdate": dict(exclude_unset=True), "RecordAppend": dict(exclude_unset=True),
                "RecordAttributes": dict(exclude_unset=True)}


def server_models() -> dict[str, type[BaseModel]]:
    return {name: cls for name, cls in vars(models).items()
            if inspect.isclass(cls) and issubclass(cls, BaseModel) and cls is not BaseModel
            and cls.__module__ == models.__name__}


PAIRS = sorted(set(server_models()) - SERVER_ONLY)


def test_every_server_model_has_its_struct():
    """A model added to the server without its Struct fails here (and gets no example)."""
    for name in PAIRS:
        assert issubclass(getattr(wire, name, object), msgspec.Struct), name
        assert name in EXAMPLES, name
    assert set(EXAMPLES) == set(PAIRS)


@pytest.mark.parametrize("name", PAIRS)
def test_fields_optionality_defaults_agree(name):
    model, struct = server_models()[name], getattr(wire, name)
    sfields = msgspec.structs.fields(struct)
    assert [f.name for f in sfields] == list(model.model_fields)
    for f in sfields:
        mf = model.model_fields[f.name]
        required = f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT
        assert required == mf.is_required(), (name, f.name)
        if required:
            continue
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        if default is msgspec.UNSET:  # not sent unless given; the server reads absent as None
            assert name in REQUESTS and mf.default is None, (name, f.name)
        else:
            assert mf.default is not PydanticUndefined and default == mf.default, (name, f.name)


def _examples():
    return [pytest.param(name, ex, id=f"{name}-{i}")
            for name in PAIRS for i, ex in enumerate(EXAMPLES[name])]


def _same(struct_value, model_value):
    """A decoded Struct equals the server's model, member by member (recursively); times
    aware and equal."""
    if isinstance(model_value, BaseModel):
        assert type(struct_value).__name__ == type(model_value).__name__
        for k in type(model_value).model_fields:
            _same(getattr(struct_value, k), getattr(model_value, k))
    elif isinstance(model_value, list):
        assert isinstance(struct_value, list) and len(struct_value) == len(model_value)
        for a, b in zip(struct_value, model_value):
            _same(a, b)
    elif isinstance(model_value, datetime):
        assert isinstance(struct_value, datetime) and struct_value.tzinfo is not None
        assert struct_value.utcoffset() == timedelta(0) and struct_value == model_value
    else:
        assert type(struct_value) is type(model_value) and struct_value == model_value


@pytest.mark.parametrize("name,example", _examples())
def test_server_json_decodes_and_encodes_back_equal(name, example):
    model, struct = server_models()[name], getattr(wire, name)
    server_obj = model.model_validate(example)
    server_json = server_obj.model_dump_json()  # what FastAPI sends for a response model
    decoded = wire.decode(server_json, struct)
    _same(decoded, server_obj)
    assert model.model_validate_json(wire.encode(decoded)) == server_obj
    if name in REQUESTS:  # StoreUpdate, BatchOperation leave out None members
        assert model.model_validate(wire.to_jsonable(decoded)) == server_obj
    else:
        assert wire.to_jsonable(decoded) == server_obj.model_dump(mode="json")


@pytest.mark.parametrize("name,example", [p for p in _examples() if p.values[0] in REQUESTS])
def test_request_bodies_are_the_bytes_pydantic_sent(name, example):
    model, struct = server_models()[name], getattr(wire, name)
    if name in ("RecordCreate", "RecordUpdate", "RecordAppend"):  # the client always passes type
        example = {"type": None, **example}
    body = wire.build(struct, **example)
    sent = wire.encode(body, exclude_none=name == "StoreUpdate")
    assert sent == model(**example).model_dump_json(**DUMP_OPTIONS.get(name, {})).encode()
    assert model.model_validate_json(sent) == model(**example)


@pytest.mark.parametrize("ttl", [None, 60])
@pytest.mark.parametrize("workspace", [None, "w"])
def test_token_create_body_as_before(workspace, ttl):
    """``create_token`` leaves None members out only when there is no ttl (as it always did)."""
    body = wire.build(wire.TokenCreate, workspace=workspace, name="n", ttl_seconds=ttl)
    old = models.TokenCreate(workspace=workspace, name="n", ttl_seconds=ttl)
    assert wire.encode(body, exclude_none=ttl is None) == old.model_dump_json(exclude_none=ttl is None).encode()


BAD_REQUESTS = [
    ("WorkspaceCreate", dict(name="Bad Name")),
    ("WorkspaceCreate", dict(name="")),
    ("StoreCreate", dict(slug="-x")),
    ("AccountCreate", dict(slug="Bad")),
    ("AccountCreate", dict(slug="a", max_stores=-1)),
    ("AccountUpdate", dict(max_bytes=-1)),
    ("TokenCreate", dict(account="Bad Name")),
    ("StoreCreate", dict(slug="s", default_type="other")),
    ("StoreCreate", dict(slug="s", max_records=0)),
    ("StoreUpdate", dict(max_store_bytes=-1)),
    ("StoreUpdate", dict(default_type="nope")),
    ("AttachmentPut", dict(access="write")),
    ("AttachmentPut", dict(instructions="x" * (models.INSTRUCTIONS_MAX_CHARS + 1))),
    ("TokenCreate", dict(name="x" * 201)),
    ("TokenCreate", dict(ttl_seconds=0)),
    ("TokenCreate", dict(ttl_seconds=models.MAX_TOKEN_TTL_SECONDS + 1)),
    ("RecordCreate", dict(path="a", content="x", mode=0o10000)),
    ("RecordCreate", dict(path="a", content="x", mode=-1)),
    ("RecordCreate", dict(path="a", content="x", mode=True)),
    ("RecordCreate", dict(path="a", content="x", mode=1.0)),
    ("RecordUpdate", dict(content="x", mtime_ns=models.MTIME_NS_MAX + 1)),
    ("RecordAttributes", dict(mtime_ns=models.MTIME_NS_MIN - 1)),
    ("RecordAttributes", dict(mode="644")),
    ("RecordAttributes", dict(mode=0o4755)),  # setuid / setgid / sticky: never kept
    ("RecordAttributes", dict(mode=0o1777)),
    ("RecordUpdate", dict(content="x", mode=0o2644)),
    ("RecordAppend", dict(append="x", mode=0o2644)),
    ("RecordAppend", dict(content="x")),
    ("RecordMove", dict(replace=True)),
    ("Restore", dict()),
    ("BatchOperation", dict(op="upsert")),
    ("BatchOperation", dict(op="create", idempotency_key="")),
    ("BatchOperation", dict(op="create", idempotency_key="k" * 256)),
    ("BatchRequest", dict(operations=[dict(op="create", body=[])])),
]


@pytest.mark.parametrize("name,fields", BAD_REQUESTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_REQUESTS)])
def test_both_refuse_the_same_bad_requests(name, fields):
    with pytest.raises(ValidationError):
        server_models()[name].model_validate(fields)
    with pytest.raises(msgspec.ValidationError):
        wire.build(getattr(wire, name), **fields)


def test_malformed_bodies_do_not_decode():
    ok = models.Record.model_validate(RECORD_MIN).model_dump(mode="json")
    for bad in ({k: v for k, v in ok.items() if k != "sha256"}, {**ok, "version": "3"},
                {**ok, "updated_at": "yesterday"}, {**ok, "mode": None}):
        with pytest.raises(msgspec.ValidationError):
            wire.decode(msgspec.json.encode(bad), wire.Record)
        with pytest.raises(ValidationError):
            models.Record.model_validate_json(msgspec.json.encode(bad), strict=True)
    with pytest.raises(msgspec.DecodeError):
        wire.decode(b'{"records": [', wire.RecordPage)
    # a newer server's extra members are ignored, as pydantic ignores them
    assert wire.decode(msgspec.json.encode({**ok, "new_member": 1}), wire.Record) == wire.decode(
        msgspec.json.encode(ok), wire.Record)


async def test_live_server_answers_decode_as_the_server_models_them():
    """Raw answers of the reference server (records, snapshot, changes, versions, events,
    attachments, stores, tokens) decode in the Structs to what its pydantic models read."""
    fake = FakeControlPlane(seed=0)
    try:
        token = await fake.setup("ws", stores=("default",))
        async with ApiClient(fake.base_url, token, transport=fake.transport, instance="i") as api:
            a = await api.create_record("default", "a.md", "one\n", type="user", mode=0o600, mtime_ns=7)
            await api.create_record("default", "b/c.md", "two ü\n")
            await api.update_record("default", a.id, "three\n", if_match=a.sha256)
            await api.move_record("default", a.id, "z.md")
        async with ApiClient(fake.base_url, fake.admin_token, transport=fake.transport) as admin:
            await admin.create_token("ws", name="n", ttl_seconds=3600)
        gets = [
            ("/v1/stores/default/records?content=true", "RecordPage", None),
            (f"/v1/stores/default/records/{a.id}?content=true", "Record", None),
            ("/v1/stores/default/changes?after=0&content=true", "ChangePage", None),
            (f"/v1/stores/default/records/{a.id}/versions", "Version", list),
            (f"/v1/stores/default/records/{a.id}/versions/1", "Version", None),
            ("/v1/workspaces/ws/events?after=0", "EventPage", None),
            ("/v1/workspaces/ws/attachments", "Attachment", list),
            ("/v1/stores", "Store", list),
            ("/v1/tokens", "TokenInfo", list),
            ("/v1/workspaces", "Workspace", list),
        ]
        async with httpx.AsyncClient(base_url=fake.base_url, transport=fake.transport,
                                     headers={"Authorization": f"Bearer {fake.admin_token}"}) as raw:
            for url, name, container in gets:
                resp = await raw.get(url)
                assert resp.status_code == 200, (url, resp.text)
                model, struct = server_models()[name], getattr(wire, name)
                if container is list:
                    server = [model.model_validate(x) for x in resp.json()]
                    decoded = wire.decode(resp.content, list[struct])
                    assert server and len(decoded) == len(server)
                else:
                    server, decoded = [model.model_validate_json(resp.content)], [wire.decode(resp.content, struct)]
                for d, s in zip(decoded, server):
                    _same(d, s)
                    assert model.model_validate_json(wire.encode(d)) == s
    finally:
        await fake.aclose()


def test_utc_datetime_binds_on_sqlite_the_text_sqlalchemy_composes():
    """``UTCDateTime.bind_processor``'s SQLite shortcut (``isoformat``) writes exactly the
    text of ``TypeDecorator``'s composition (``process_bind_param``, then SQLite
    ``DATETIME``'s storage format): aware times in any zone, naive ones, whole seconds, the
    years 1-9999; None goes through the composition."""
    import random
    from datetime import timezone as tzmod

    from sqlalchemy.dialects import sqlite
    from sqlalchemy.types import TypeDecorator

    from memfuse.server.db import UTCDateTime

    dialect = sqlite.dialect()
    impl = UTCDateTime().dialect_impl(dialect)
    fast = impl.bind_processor(dialect)
    composed = TypeDecorator.bind_processor(impl, dialect)
    assert fast is not None and composed is not None and fast.__qualname__ != composed.__qualname__
    rng = random.Random(11)
    zones = [None, timezone.utc, tzmod(timedelta(hours=5, minutes=30)), tzmod(timedelta(hours=-11))]
    for _ in range(20_000):
        t = datetime(1, 1, 2) + timedelta(seconds=rng.randint(0, 86400 * 365 * 9997),
                                          microseconds=rng.choice([0, rng.randint(0, 999_999)]))
        t = t.replace(tzinfo=rng.choice(zones))
        assert fast(t) == composed(t), t
    assert fast(None) is None is composed(None)


def test_snapshot_times_read_from_sqlite_text_equal_sqlalchemys():
    """The snapshot endpoint parses SQLite's stored times itself (memfuse.server.records.
    _sqlite_time): the same aware datetimes as the column type's own reading, microseconds
    and whole seconds alike, and other text still goes through SQLAlchemy."""
    import random

    from sqlalchemy.dialects import sqlite

    from memfuse.server.db import UTCDateTime
    from memfuse.server.records import _sqlite_time

    dialect = sqlite.dialect()
    impl = UTCDateTime().dialect_impl(dialect)
    store, read = impl.bind_processor(dialect), impl.result_processor(dialect, None)
    rng = random.Random(7)
    for _ in range(20_000):
        t = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(
            seconds=rng.randint(0, 86400 * 365 * 3000), microseconds=rng.choice([0, rng.randint(0, 999_999)]))
        text = store(UTCDateTime().process_bind_param(t, dialect))
        mine = _sqlite_time(text)
        assert mine == read(text) == t and mine.utcoffset() == timedelta(0) and mine.isoformat() == t.isoformat()
    assert _sqlite_time("2026-12-01 06:08:36") == datetime(2026, 12, 1, 6, 8, 36, tzinfo=timezone.utc)
    assert _sqlite_time("2026-12-01 06:08:36.5") == datetime(2026, 12, 1, 6, 8, 36, 500000, tzinfo=timezone.utc)


def test_a_create_answer_encoded_by_msgspec_is_pydantics_record_json():
    """A create's answer is ``wire.Record`` encoded by msgspec (``recordrows.record_answer``,
    ``base.answer_json``), no longer a pydantic ``Record``: the same bytes as
    ``_record_model(...).model_dump_json()`` for random records (times with and without
    microseconds, naive and aware frontmatter dates, no type, attributes set or not, text
    that JSON escapes); and the stored headers of an idempotent answer are
    ``json.dumps``' (``base.headers_json``)."""
    import json
    import random

    from memfuse.server.base import answer_json, headers_json
    from memfuse.server.recordrows import _Rec, _record_model, record_answer

    rng = random.Random(17)
    texts = ["notes/a.md", "ü ß/\u2028\x01\"q\"\\.md", "MEMORY.md", "日本/語.md", "a/\ud7ff\ue000.md"]

    def when(naive: bool = False) -> datetime | None:
        if rng.random() < 0.3:
            return None
        t = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(
            seconds=rng.randint(0, 86400 * 365 * 100), microseconds=rng.choice([0, rng.randint(0, 999_999)]))
        return t.replace(tzinfo=None) if naive else t

    for _ in range(3000):
        created = when() or T1
        rec = _Rec(id=f"{rng.getrandbits(128):032x}", store=rng.choice(["s", "notes~acme", "a.b-c"]),
                   path=rng.choice(texts), type=rng.choice([None, "user", "project"]),
                   version=rng.randint(1, 2**40), sha256=f"{rng.getrandbits(256):064x}",
                   size=rng.randint(0, 2**20), content="x", deleted=rng.random() < 0.1,
                   created_at=created, updated_at=rng.choice([created, when() or T2]),
                   updated_by=rng.choice(["ws:w/side-1", "admin:static", "ws:ü/\x7f"]),
                   seq=rng.randint(1, 2**62), mode=rng.choice([None, 0o644, 0o4755, 0]),
                   mtime_ns=rng.choice([None, 0, -1_577_923_200_123_456_789, 2**62]),
                   review_after=when(rng.random() < 0.5), expires_at=when())
        assert answer_json(record_answer(rec)) == _record_model(rec, with_content=False).model_dump_json().encode()
        etag = f'"{rec.sha256}"'
        for headers in ({"ETag": etag}, {}, {"ETag": '"a\\b"'}, {"ETag": '"é"'}, {"ETag": '""'},
                        {"ETag": etag, "X": "y"}, {"ETag": "x"}):
            assert headers_json(headers) == json.dumps(headers)
