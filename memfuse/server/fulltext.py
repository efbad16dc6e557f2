"""The full-text index of live records and ranked search over it (``order=relevance``).

One index per database, kept by the database itself in the transaction of every write to
``records`` (so every write path, the batch's deferred inserts and a future one alike, keeps
it without a line of Python):

- **SQLite**: an FTS5 table ``records_fts(path, headings, body)`` whose rowid is the
  record's *full-text key* negated: ``-k`` of its row ``(k, record_id)`` in
  ``records_fts_keys`` (``k`` an ``INTEGER PRIMARY KEY`` given at the record's first
  indexing, kept while the record's row exists; revision ``0016_fts_record_keys``; before it
  the rowid was the record's ``seq``, new at every write, so every write re-indexed the
  record). Negated so that no key equals a ``seq``: a previous release's ranked search, which
  joins on ``seq``, finds nothing during a rolling update instead of wrong records. Filled
  by three triggers on ``records`` (``records_fts_ai`` / ``_au`` / ``_ad``) for the rows
  that are live and have their seq (``deleted = 0 AND seq > 0``; a new record is inserted
  with its seq, ``recordrows.next_seq_sql``; a release before session 18 inserted it with
  seq 0 and gave it its seq by the next statement, ``records_fts_au_seq``), from the first ``PG_MAX_CHARS``
  characters of the content, as on PostgreSQL. ``records_fts_au`` does nothing when the
  indexed text is unchanged (live before and after, same path, same first ``PG_MAX_CHARS``
  characters): an append to a record longer than that, or a change of its attributes, costs
  the index nothing (an append to a 1 MiB record: ~48 ms of tokenizing and index writes
  less). ``OR REPLACE``: a write is never refused for the index. ``headings`` is
  the output of the SQL function ``memfuse_headings(content)`` that ``Database`` registers on
  every connection (``register_sqlite_functions``): a connection without it (the ``sqlite3``
  shell, a memfuse older than revision ``0007_fulltext``) cannot write records. The FTS
  table keeps its own copy of the indexed text (so a delete needs only the rowid, and a
  change of the headings rule never corrupts it). Tokenizer ``unicode61`` (letters and
  digits, Unicode lowercase, diacritics kept); a hit joins ``records_fts_keys`` by its key,
  then ``records`` by id through ``ix_records_fts_hit`` (``id, store, deleted, path,
  type``), which covers the join and the page's filters without reading a record's row
  (its content). Ranked by ``bm25`` with weights path 10, headings 4, body 1.
- **PostgreSQL**: a column ``records.search_vector`` (``tsvector``, configuration
  ``simple``: lowercase, no stemming, like the SQLite side) of the path (weight A), the
  headings (B) and the content (D), computed by the database from SQL alone
  (``PG_VECTOR_SQL``) in the ``BEFORE INSERT OR UPDATE`` trigger ``records_search_vector``
  (function ``memfuse_records_search_vector``), which keeps the old vector when the path
  and the first ``PG_MAX_CHARS`` characters are unchanged (revision
  ``0016_fts_record_keys``; before it a stored generated column, computed again at every
  write of the row), with a partial GIN index on the live records (``ix_records_search``). Ranked by ``ts_rank_cd`` (weights D 0.1, B 0.4, A 1.0: the same
  ratios as the SQLite side). The text given to ``to_tsvector`` has ``/ . - _ @ : \\``
  replaced by spaces (so ``notes/deploy.md`` is the words ``notes deploy md`` as on SQLite,
  not one "file" token) and is cut at ``PG_MAX_CHARS`` characters (a ``tsvector`` holds at
  most 1 MiB; a longer record's tail is not indexed, its substring search still finds it).

**Pending** (SQLite; revisions ``0020_fts_pending``, ``0023_fts_queue_ids``,
``0024_fts_queue_updates``): a *new*
record is not indexed in its write's transaction. ``records_fts_ai`` / ``records_fts_au_seq``
queue its id in ``records_fts_pending`` (``WITHOUT ROWID``: one page of the write-ahead log
a create; 0020 gave the key there and queued it, three pages: bench/README.md, "The close
path, session 21: serve's WAL pages"); ``PENDING_DRAIN`` gives every queued live record its
key (a restored record has one already: a key is kept while the record's row exists), indexes
them in one statement (the same rows and text the triggers wrote before, so ranking is the
same) and empties the queue. Ranked search drains first (``Database.index_pending``, in a write
transaction before its read), so it finds every record written before it started; a writer
drains after every ``DRAIN_EVERY`` write transactions (``Database.write_conn``), so the queue
stays short when nothing searches. Why: the index's trigger was ~17 % of the writer's
instructions per single-record create (FTS5 writes a segment per transaction: its data,
index, docsize and content pages), paid once per drain instead (bench/README.md, "The close
path, session 13: serve's writer"). Updates too (revision ``0024_fts_queue_updates``):
``records_fts_au`` queues the id of a row that is indexable after an update that changed its
path or indexed head (an append or an update of a record under ``PG_MAX_CHARS`` characters, a
move, a restore) instead of writing its whole indexed text to the FTS table in the write's
transaction (~45 % of an append's pages of the write-ahead log: bench/README.md, "The close
path, session 22: appends re-indexed at the drain"); until the drain its FTS row holds the
text before, which nothing reads (only ranked search reads ``records_fts``, after draining),
and the drain's ``INSERT OR REPLACE`` by its key replaces it. A row that stops being
indexable (a delete) leaves the FTS table at once, in its write's transaction
(``records_fts_au``, ``records_fts_ad``; ranked search also joins ``records`` and skips a
deleted one); the drain skips a queued record deleted or purged since. A release older than
``0023_fts_queue_ids`` cannot drain this queue: upgrade every replica before serving ranked
search (one of ``0023`` drains what ``0024``'s trigger queues).

Neither is a SQLAlchemy model: ``install`` hooks their DDL to ``Base.metadata``'s
``after_create`` (in-memory databases, tests), and revision ``0007_fulltext`` creates and
fills them on an existing database (in the form keyed by ``seq``: ``create_statements``),
``0016_fts_record_keys`` re-keys them (``rekey_statements``). Both are listed in ``INDEX_OBJECTS`` for the schema
comparison of ``tests/test_migrations.py``.

A query is ranked by its words (``terms``: runs of letters and digits, Unicode lowercase,
at most ``MAX_TERMS``), every word required, each as a prefix (``deploy`` finds
``deployment``). Scores are "higher is better" and comparable within one result list only
(bm25 and ts_rank_cd differ in scale).
"""
from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterable
from typing import Any

from sqlalchemy import DDL, MetaData, event

HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+|$)(.*)$", re.MULTILINE)
#: ``HEADING`` at a line start after the first: from the newline before it
_AFTER_NEWLINE = re.compile(r"\n {0,3}#{1,6}(?:[ \t]+|$)(.*)$", re.MULTILINE)
WORD = re.compile(r"[^\W_]+")
MAX_TERMS = 16  # words of a query used for ranking at most
MAX_TERM_CHARS = 64  # a longer word is cut (no token that long is in a text worth finding)
SQLITE_WEIGHTS = (10.0, 4.0, 1.0)  # bm25 weights of path, headings, body
PG_MAX_CHARS = 200_000  # characters of a record's content given to to_tsvector
PG_SEPARATORS = "/.-_@:\\"
INDEX_OBJECTS = {  # what this module adds beside the models (tables, indexes, columns, triggers)
    "tables": {"records_fts", "records_fts_data", "records_fts_idx", "records_fts_docsize",
               "records_fts_config", "records_fts_content", "records_fts_keys", "records_fts_pending"},
    "indexes": {"ix_records_seq", "ix_records_fts_hit", "ix_records_search"},
    "columns": {"search_vector"},
}


def headings(content: str | None) -> str:
    """The Markdown ATX headings of ``content`` (lines ``# …`` to ``###### …``, up to three
    spaces before), their text one per line; ``""`` for None. The SQLite side's
    ``memfuse_headings``; ``PG_HEADINGS_SQL`` is the same rule in SQL."""
    if not content:
        return ""
    # the same matches as ``HEADING.finditer(content)``: the first line, then each line
    # found from its newline (``_AFTER_NEWLINE`` starts with a literal, which the regex
    # engine finds by scanning, instead of trying the pattern at every character: a
    # 200,000-character record, indexed at every write (``PG_MAX_CHARS``), in a fraction of
    # the time)
    first = HEADING.match(content)
    found = [m.group(1) for m in _AFTER_NEWLINE.finditer(content)]
    return "\n".join([first.group(1), *found] if first is not None else found)


def register_sqlite_functions(dbapi_conn: sqlite3.Connection) -> None:
    """Register ``memfuse_headings(text)`` (deterministic) on a new SQLite connection: the
    triggers of ``records_fts`` call it."""
    dbapi_conn.create_function("memfuse_headings", 1, headings, deterministic=True)


# ------------------------------------------------------------------ DDL

# The form revisions 0007_fulltext and 0011_append_versions made (rowid = the record's seq):
# what they create on an existing database, so that a database upgraded step by step ends
# with what ``install`` makes (re-keyed by 0016_fts_record_keys: ``rekey_statements``).
_SEQ_KEYED_DDL = [
    "CREATE VIRTUAL TABLE IF NOT EXISTS records_fts USING fts5("
    "path, headings, body, tokenize = 'unicode61 remove_diacritics 0')",
    # covering: a hit's join to its record reads the index only, never the row (with content)
    "CREATE INDEX IF NOT EXISTS ix_records_seq ON records (seq, store, deleted, path, id, type)",
    "CREATE TRIGGER IF NOT EXISTS records_fts_ai AFTER INSERT ON records "
    "WHEN new.deleted = 0 AND new.seq > 0 BEGIN "
    "INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) "
    f"VALUES (new.seq, new.path, memfuse_headings(substr(new.content, 1, {PG_MAX_CHARS})), "
    f"coalesce(substr(new.content, 1, {PG_MAX_CHARS}), '')); END",
    "CREATE TRIGGER IF NOT EXISTS records_fts_ad AFTER DELETE ON records "
    "WHEN old.deleted = 0 AND old.seq > 0 BEGIN "
    "DELETE FROM records_fts WHERE rowid = old.seq; END",
    "CREATE TRIGGER IF NOT EXISTS records_fts_au AFTER UPDATE ON records BEGIN "
    "DELETE FROM records_fts WHERE old.deleted = 0 AND old.seq > 0 AND rowid = old.seq; "
    "INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) "
    f"SELECT new.seq, new.path, memfuse_headings(substr(new.content, 1, {PG_MAX_CHARS})), "
    f"coalesce(substr(new.content, 1, {PG_MAX_CHARS}), '') "
    "WHERE new.deleted = 0 AND new.seq > 0; END",
]
_SEQ_KEYED_BACKFILL = ("INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) "
                       f"SELECT seq, path, memfuse_headings(substr(content, 1, {PG_MAX_CHARS})), "
                       f"coalesce(substr(content, 1, {PG_MAX_CHARS}), '') FROM records "
                       "WHERE deleted = 0 AND seq > 0")
#: the two triggers that index a written record (revision ``0011_append_versions`` made them
#: index the first ``PG_MAX_CHARS`` characters, as on PostgreSQL; ``refresh_statements``)
SQLITE_WRITE_TRIGGERS = ("records_fts_ai", "records_fts_au")
_TRIGGERS = ("records_fts_au", "records_fts_ad", "records_fts_ai", "records_fts_au_seq")

_KEY_OF_NEW = "-(SELECT k FROM records_fts_keys WHERE record_id = new.id)"
_KEY_OF_OLD = "-(SELECT k FROM records_fts_keys WHERE record_id = old.id)"
_NEW_ROW = (f"new.path, memfuse_headings(substr(new.content, 1, {PG_MAX_CHARS})), "
            f"coalesce(substr(new.content, 1, {PG_MAX_CHARS}), '')")
#: ``records_fts_au``'s condition (every form since ``0016_fts_record_keys``): the row was or
#: is indexable, unless it is live before and after with the same path and indexed head
_AU_WHEN = ("WHEN NOT (old.deleted = 0 AND old.seq > 0 AND new.deleted = 0 AND new.seq > 0 "
            "AND old.path IS new.path "
            f"AND substr(old.content, 1, {PG_MAX_CHARS}) IS substr(new.content, 1, {PG_MAX_CHARS})) BEGIN ")
#: the index as revision ``0016_fts_record_keys`` leaves it (module docstring): the FTS rowid
#: is ``-k`` of the record's row in ``records_fts_keys``
_KEYED_DDL_0016 = [
    _SEQ_KEYED_DDL[0],
    "CREATE TABLE IF NOT EXISTS records_fts_keys (k INTEGER PRIMARY KEY, record_id VARCHAR(36) NOT NULL UNIQUE)",
    # covering: a hit's join to its record reads the index only, never the row (with content)
    "CREATE INDEX IF NOT EXISTS ix_records_fts_hit ON records (id, store, deleted, path, type)",
    "CREATE TRIGGER IF NOT EXISTS records_fts_ai AFTER INSERT ON records "
    "WHEN new.deleted = 0 AND new.seq > 0 BEGIN "
    "INSERT OR IGNORE INTO records_fts_keys (record_id) VALUES (new.id); "
    f"INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) VALUES ({_KEY_OF_NEW}, {_NEW_ROW}); END",
    "CREATE TRIGGER IF NOT EXISTS records_fts_ad AFTER DELETE ON records BEGIN "
    f"DELETE FROM records_fts WHERE old.deleted = 0 AND old.seq > 0 AND rowid = {_KEY_OF_OLD}; "
    "DELETE FROM records_fts_keys WHERE record_id = old.id; END",
    # nothing to do when the indexed text stays (an append past PG_MAX_CHARS, an attribute)
    "CREATE TRIGGER IF NOT EXISTS records_fts_au AFTER UPDATE ON records " + (_AU_BODY := (
        _AU_WHEN +
        f"DELETE FROM records_fts WHERE old.deleted = 0 AND old.seq > 0 AND rowid = {_KEY_OF_OLD}; "
        "INSERT OR IGNORE INTO records_fts_keys (record_id) SELECT new.id WHERE new.deleted = 0 AND new.seq > 0; "
        f"INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) SELECT {_KEY_OF_NEW}, {_NEW_ROW} "
        "WHERE new.deleted = 0 AND new.seq > 0; END")),
]
#: the update triggers as revision ``0018_record_tails`` makes them: ``records_fts_au`` runs
#: only for a statement that sets the path, the content or ``deleted`` (an append to a record
#: with a tail sets none of them: its trigger compared two 200,000-character heads of a
#: 1 MiB row for nothing, ~1 ms), ``records_fts_au_seq`` indexes a new record when the
#: statement after its insert gives it its seq (the only other change that makes a row
#: indexable)
_AU = "CREATE TRIGGER IF NOT EXISTS records_fts_au AFTER UPDATE OF path, content, deleted ON records " + _AU_BODY
_AU_SEQ = ("CREATE TRIGGER IF NOT EXISTS records_fts_au_seq AFTER UPDATE OF seq ON records "
           "WHEN old.seq <= 0 AND new.seq > 0 AND new.deleted = 0 BEGIN "
           "INSERT OR IGNORE INTO records_fts_keys (record_id) VALUES (new.id); "
           f"INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) VALUES ({_KEY_OF_NEW}, {_NEW_ROW}); END")
# A new record's indexing deferred (revision ``0020_fts_pending``): its insert (a batch's,
# seq given) or the statement giving it its seq (a single create) gave it its key and queued
# the key; ``_PENDING_DRAIN_0020`` indexed the queue in one statement. Revision
# ``0023_fts_queue_ids`` queues the record's id instead (``_QUEUE_TABLE``): its key is given
# at the drain.
_PENDING_TABLE = "CREATE TABLE IF NOT EXISTS records_fts_pending (k INTEGER PRIMARY KEY)"
_QUEUE_NEW = ("INSERT OR IGNORE INTO records_fts_keys (record_id) VALUES (new.id); "
              "INSERT OR IGNORE INTO records_fts_pending (k) "
              "SELECT k FROM records_fts_keys WHERE record_id = new.id; END")
_AI_PENDING = ("CREATE TRIGGER IF NOT EXISTS records_fts_ai AFTER INSERT ON records "
               "WHEN new.deleted = 0 AND new.seq > 0 BEGIN " + _QUEUE_NEW)
_AU_SEQ_PENDING = ("CREATE TRIGGER IF NOT EXISTS records_fts_au_seq AFTER UPDATE OF seq ON records "
                   "WHEN old.seq <= 0 AND new.seq > 0 AND new.deleted = 0 BEGIN " + _QUEUE_NEW)
_PENDING_DRAIN_0020 = [
    "INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) "
    f"SELECT -k.k, r.path, memfuse_headings(substr(r.content, 1, {PG_MAX_CHARS})), "
    f"coalesce(substr(r.content, 1, {PG_MAX_CHARS}), '') FROM records_fts_pending p "
    "JOIN records_fts_keys k ON k.k = p.k JOIN records r ON r.id = k.record_id "
    "WHERE r.deleted = 0 AND r.seq > 0",
    "DELETE FROM records_fts_pending",
]
#: the queue of revision ``0023_fts_queue_ids`` (module docstring, "Pending"): the ids of the
#: new records not indexed yet, one b-tree (``WITHOUT ROWID``) that a create writes one page
#: of; the 0020 form wrote three (the key's row, ``records_fts_keys``' index of record ids,
#: the queued key)
_QUEUE_TABLE = ("CREATE TABLE IF NOT EXISTS records_fts_pending "
                "(record_id VARCHAR(36) NOT NULL PRIMARY KEY) WITHOUT ROWID")
_QUEUE_NEW_ID = "INSERT OR IGNORE INTO records_fts_pending (record_id) VALUES (new.id); END"
_AI_QUEUE = ("CREATE TRIGGER IF NOT EXISTS records_fts_ai AFTER INSERT ON records "
             "WHEN new.deleted = 0 AND new.seq > 0 BEGIN " + _QUEUE_NEW_ID)
_AU_SEQ_QUEUE = ("CREATE TRIGGER IF NOT EXISTS records_fts_au_seq AFTER UPDATE OF seq ON records "
                 "WHEN old.seq <= 0 AND new.seq > 0 AND new.deleted = 0 BEGIN " + _QUEUE_NEW_ID)
#: ``records_fts_au`` as revision ``0024_fts_queue_updates`` makes it (module docstring,
#: "Pending"): a row that stops being indexable (a delete) leaves the index now; one that is
#: indexable after the update (an append or an update of a live record whose path or indexed
#: head changed, a move, a restore) is queued, its FTS row (the old text, if any) replaced by
#: the drain's ``INSERT OR REPLACE`` by its key. An append to a record under ``PG_MAX_CHARS``
#: wrote its whole indexed text to the FTS table in its transaction before (~45 % of its
#: write-ahead log pages): one page of the queue now (bench/README.md, "The close path,
#: session 22: appends re-indexed at the drain")
_AU_QUEUE = ("CREATE TRIGGER IF NOT EXISTS records_fts_au AFTER UPDATE OF path, content, deleted ON records "
             + _AU_WHEN +
             "DELETE FROM records_fts WHERE old.deleted = 0 AND old.seq > 0 "
             f"AND NOT (new.deleted = 0 AND new.seq > 0) AND rowid = {_KEY_OF_OLD}; "
             "INSERT OR IGNORE INTO records_fts_pending (record_id) SELECT new.id "
             "WHERE new.deleted = 0 AND new.seq > 0; END")
#: the index as ``install`` makes it and revision ``0024_fts_queue_updates`` leaves it
SQLITE_DDL = [*_KEYED_DDL_0016[:3], _QUEUE_TABLE, _AI_QUEUE, _KEYED_DDL_0016[4], _AU_QUEUE, _AU_SEQ_QUEUE]
#: whether any record waits for its indexing (SQLite)
PENDING_ANY = "SELECT 1 FROM records_fts_pending LIMIT 1"
#: give every queued live record its key (kept if it has one: an updated or restored record,
#: or one a release before ``0024_fts_queue_updates`` indexed at a write), index it (as
#: ``_AI`` / ``_AU_SEQ`` / ``_AU`` would have at its write: the same row, the same text; an
#: updated record's FTS row, the text before, replaced by its key; one deleted or purged
#: since is skipped), then empty the queue
PENDING_DRAIN = [
    "INSERT OR IGNORE INTO records_fts_keys (record_id) SELECT r.id FROM records_fts_pending p "
    "JOIN records r ON r.id = p.record_id WHERE r.deleted = 0 AND r.seq > 0",
    "INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) "
    f"SELECT -k.k, r.path, memfuse_headings(substr(r.content, 1, {PG_MAX_CHARS})), "
    f"coalesce(substr(r.content, 1, {PG_MAX_CHARS}), '') FROM records_fts_pending p "
    "JOIN records r ON r.id = p.record_id JOIN records_fts_keys k ON k.record_id = r.id "
    "WHERE r.deleted = 0 AND r.seq > 0",
    "DELETE FROM records_fts_pending",
]
#: a writer that committed this many write transactions since the last drain drains
#: (``Database.write_conn``): the queue stays short when nothing searches
DRAIN_EVERY = 256
_KEYED_BACKFILL = [
    "INSERT OR IGNORE INTO records_fts_keys (record_id) SELECT id FROM records WHERE deleted = 0 AND seq > 0",
    "INSERT OR REPLACE INTO records_fts (rowid, path, headings, body) "
    f"SELECT -k.k, r.path, memfuse_headings(substr(r.content, 1, {PG_MAX_CHARS})), "
    f"coalesce(substr(r.content, 1, {PG_MAX_CHARS}), '') FROM records r "
    "JOIN records_fts_keys k ON k.record_id = r.id WHERE r.deleted = 0 AND r.seq > 0",
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS records_fts_au_seq", "DROP TRIGGER IF EXISTS records_fts_au", "DROP TRIGGER IF EXISTS records_fts_ad",
               "DROP TRIGGER IF EXISTS records_fts_ai", "DROP INDEX IF EXISTS ix_records_seq",
               "DROP INDEX IF EXISTS ix_records_fts_hit", "DROP TABLE IF EXISTS records_fts_keys",
               "DROP TABLE IF EXISTS records_fts_pending", "DROP TABLE IF EXISTS records_fts"]


def _pg_words(expr: str) -> str:
    return f"translate({expr}, '{PG_SEPARATORS}', '{' ' * len(PG_SEPARATORS)}')"


def _pg_vector_sql(row: str = "") -> str:
    """The ``tsvector`` of a record's path (A), headings (B) and content (D), the columns
    named with ``row`` (``""``, or ``"NEW."`` in a trigger function)."""
    content = f"left(coalesce({row}content, ''), {PG_MAX_CHARS})"
    # the heading lines' text: every other line emptied, then the leading #s taken off
    headings = (f"regexp_replace(regexp_replace({content}, '^(?! {{0,3}}#{{1,6}}([ \\t]|$)).*$', '', 'gn'), "
                "'^ {0,3}#{1,6}', '', 'gn')")
    return (f"setweight(to_tsvector('simple'::regconfig, {_pg_words(row + 'path')}), 'A') || "
            f"setweight(to_tsvector('simple'::regconfig, {_pg_words(headings)}), 'B') || "
            f"setweight(to_tsvector('simple'::regconfig, {_pg_words(content)}), 'D')")


_PG_CONTENT = f"left(coalesce(content, ''), {PG_MAX_CHARS})"
PG_HEADINGS_SQL = (f"regexp_replace(regexp_replace({_PG_CONTENT}, '^(?! {{0,3}}#{{1,6}}([ \\t]|$)).*$', '', 'gn'), "
                   "'^ {0,3}#{1,6}', '', 'gn')")
PG_VECTOR_SQL = _pg_vector_sql()
_PG_INDEX = ("CREATE INDEX IF NOT EXISTS ix_records_search ON records USING gin (search_vector) "
             "WHERE deleted = false")
# The form revision 0007_fulltext made: a stored generated column, computed again at every
# write of the row (an append to a 1 MiB record: ~100 ms), re-made by 0016_fts_record_keys
_PG_GENERATED_DDL = [
    f"ALTER TABLE records ADD COLUMN IF NOT EXISTS search_vector tsvector "
    f"GENERATED ALWAYS AS ({PG_VECTOR_SQL}) STORED",
    _PG_INDEX,
]
_PG_FUNCTION = (
    "CREATE OR REPLACE FUNCTION memfuse_records_search_vector() RETURNS trigger LANGUAGE plpgsql AS $fn$ "
    "BEGIN "
    "IF TG_OP = 'UPDATE' AND NEW.path IS NOT DISTINCT FROM OLD.path "
    f"AND left(NEW.content, {PG_MAX_CHARS}) IS NOT DISTINCT FROM left(OLD.content, {PG_MAX_CHARS}) THEN "
    "NEW.search_vector := OLD.search_vector; "
    f"ELSE NEW.search_vector := {_pg_vector_sql('NEW.')}; "
    "END IF; RETURN NEW; END $fn$"
)
_PG_TRIGGER_0016 = ("CREATE TRIGGER records_search_vector BEFORE INSERT OR UPDATE ON records "
                    "FOR EACH ROW EXECUTE FUNCTION memfuse_records_search_vector()")
#: revision ``0018_record_tails``: only a statement that sets the path or the content runs it
#: (an append to a record with a tail sets neither; the column keeps its value otherwise)
_PG_TRIGGER = ("CREATE TRIGGER records_search_vector BEFORE INSERT OR UPDATE OF path, content ON records "
               "FOR EACH ROW EXECUTE FUNCTION memfuse_records_search_vector()")
#: the index as ``install`` makes it and revision ``0018_record_tails`` leaves it: a plain
#: column kept by a trigger that copies the old vector when the path and the indexed head
#: are unchanged (module docstring; ``0016_fts_record_keys`` ran it at every update)
PG_DDL = [
    "ALTER TABLE records ADD COLUMN IF NOT EXISTS search_vector tsvector",
    _PG_FUNCTION,
    "DROP TRIGGER IF EXISTS records_search_vector ON records",
    _PG_TRIGGER,
    _PG_INDEX,
]
PG_DROP = ["DROP INDEX IF EXISTS ix_records_search", "DROP TRIGGER IF EXISTS records_search_vector ON records",
           "DROP FUNCTION IF EXISTS memfuse_records_search_vector()",
           "ALTER TABLE records DROP COLUMN IF EXISTS search_vector"]


def install(metadata: MetaData) -> None:
    """Create the index with the tables (``metadata.create_all``: in-memory databases and
    the schema tests), after ``records`` exists; the dialect's DDL only."""
    # DDL(): SQLAlchemy 2.0 leaves its constructor unannotated
    for stmt in SQLITE_DDL:
        event.listen(metadata, "after_create", DDL(stmt).execute_if(dialect="sqlite"))  # type: ignore[no-untyped-call]
    for stmt in PG_DDL:
        event.listen(metadata, "after_create", DDL(stmt).execute_if(dialect="postgresql"))  # type: ignore[no-untyped-call]


def create_statements(dialect: str) -> list[str]:
    """The SQL that creates the index on an existing database of ``dialect`` and fills it
    from the live records (revision ``0007_fulltext``, in its form keyed by ``seq``, which
    ``0016_fts_record_keys`` re-keys; PostgreSQL computes the generated column as it adds
    it); ``[]`` for another dialect."""
    return {"sqlite": [*_SEQ_KEYED_DDL, _SEQ_KEYED_BACKFILL], "postgresql": list(_PG_GENERATED_DDL)}.get(dialect, [])


def refresh_statements(dialect: str) -> list[str]:
    """The SQL that replaces SQLite's write triggers with this module's (revision
    ``0011_append_versions``: index the first ``PG_MAX_CHARS`` characters of a record, so a
    write to a large record, an append above all, costs a bounded reindex); ``[]`` on
    PostgreSQL, whose generated column always had that bound."""
    if dialect != "sqlite":
        return []
    create = [d for d in _SEQ_KEYED_DDL if any(f"TRIGGER IF NOT EXISTS {t} " in d for t in SQLITE_WRITE_TRIGGERS)]
    return [*(f"DROP TRIGGER IF EXISTS {t}" for t in SQLITE_WRITE_TRIGGERS), *create]


def rekey_statements(dialect: str) -> list[str]:
    """The SQL that re-keys SQLite's index by record (revision ``0016_fts_record_keys``,
    module docstring): the seq-keyed triggers and ``ix_records_seq`` replaced, every live
    record given its key and indexed again (one pass over the live records, as
    ``0007_fulltext``'s fill). PostgreSQL: the generated column becomes a plain one (its
    values kept: no rewrite of the table), kept from now on by the trigger
    ``records_search_vector``; ``[]`` for another dialect."""
    if dialect == "postgresql":
        return ["ALTER TABLE records ALTER COLUMN search_vector DROP EXPRESSION", *PG_DDL[1:3], _PG_TRIGGER_0016]
    if dialect != "sqlite":
        return []
    return [*(f"DROP TRIGGER IF EXISTS {t}" for t in _TRIGGERS), "DROP INDEX IF EXISTS ix_records_seq",
            "DELETE FROM records_fts", *_KEYED_DDL_0016[1:3], *_KEYED_BACKFILL, *_KEYED_DDL_0016[3:]]


def update_trigger_statements(dialect: str, *, upgrade: bool = True) -> list[str]:
    """The SQL that makes the update triggers run only for a statement that sets what the
    index reads (revision ``0018_record_tails``: ``_AU``, ``_AU_SEQ``, ``_PG_TRIGGER``), or,
    with ``upgrade`` False, puts back ``0016_fts_record_keys``'s (its downgrade)."""
    if dialect == "postgresql":
        return ["DROP TRIGGER IF EXISTS records_search_vector ON records",
                _PG_TRIGGER if upgrade else _PG_TRIGGER_0016]
    if dialect != "sqlite":
        return []
    drop = ["DROP TRIGGER IF EXISTS records_fts_au", "DROP TRIGGER IF EXISTS records_fts_au_seq"]
    return [*drop, _AU, _AU_SEQ] if upgrade else [*drop, _KEYED_DDL_0016[5]]


def pending_statements(dialect: str, *, upgrade: bool = True) -> list[str]:
    """The SQL that defers a new record's indexing to ``PENDING_DRAIN`` (revision
    ``0020_fts_pending``: the queue ``records_fts_pending``, ``records_fts_ai`` and
    ``records_fts_au_seq`` queueing), or, with ``upgrade`` False, indexes the queue and puts
    back ``0018_record_tails``'s triggers (its downgrade). ``[]`` on PostgreSQL, whose
    trigger computes the vector in the row."""
    if dialect != "sqlite":
        return []
    drop = ["DROP TRIGGER IF EXISTS records_fts_ai", "DROP TRIGGER IF EXISTS records_fts_au_seq"]
    if upgrade:
        return [_PENDING_TABLE, *drop, _AI_PENDING, _AU_SEQ_PENDING]
    return [*_PENDING_DRAIN_0020, *drop, "DROP TABLE IF EXISTS records_fts_pending", _KEYED_DDL_0016[3], _AU_SEQ]


def queue_id_statements(dialect: str, *, upgrade: bool = True) -> list[str]:
    """The SQL that makes the queue of new records hold their ids, their keys given at the
    drain (revision ``0023_fts_queue_ids``: ``_QUEUE_TABLE``, ``records_fts_ai`` and
    ``records_fts_au_seq`` queueing the id), or, with ``upgrade`` False, puts back
    ``0020_fts_pending``'s queue of keys (its downgrade). Either way the queue is drained
    first in the form it has (its records indexed), so it starts empty. ``[]`` on PostgreSQL."""
    if dialect != "sqlite":
        return []
    drop = ["DROP TRIGGER IF EXISTS records_fts_ai", "DROP TRIGGER IF EXISTS records_fts_au_seq",
            "DROP TABLE IF EXISTS records_fts_pending"]
    if upgrade:
        return [*_PENDING_DRAIN_0020, *drop, _QUEUE_TABLE, _AI_QUEUE, _AU_SEQ_QUEUE]
    return [*PENDING_DRAIN, *drop, _PENDING_TABLE, _AI_PENDING, _AU_SEQ_PENDING]


def queue_update_statements(dialect: str, *, upgrade: bool = True) -> list[str]:
    """The SQL that makes ``records_fts_au`` queue an updated record that stays or becomes
    indexable instead of indexing it in the write's transaction (revision
    ``0024_fts_queue_updates``: ``_AU_QUEUE``), or, with ``upgrade`` False, puts back
    ``0018_record_tails``'s ``_AU`` (its downgrade; records queued by either form are indexed
    by the same drain). ``[]`` on PostgreSQL."""
    if dialect != "sqlite":
        return []
    return ["DROP TRIGGER IF EXISTS records_fts_au", _AU_QUEUE if upgrade else _AU]


def drain(conn: Any) -> None:
    """Index the records queued in ``records_fts_pending`` and empty the queue, in the
    caller's SQLite write transaction (``conn``: a Core ``Connection``). Cost: tokenizing
    each queued record's first ``PG_MAX_CHARS`` characters, in one statement."""
    for stmt in PENDING_DRAIN:
        conn.exec_driver_sql(stmt)


def unkey_statements(dialect: str) -> list[str]:
    """The SQL that puts SQLite's index back in its form keyed by ``seq`` (downgrade of
    ``0016_fts_record_keys``); on PostgreSQL the generated column again (the table rewritten,
    every vector computed)."""
    if dialect == "postgresql":
        return [*PG_DROP, *_PG_GENERATED_DDL]
    if dialect != "sqlite":
        return []
    return [*(f"DROP TRIGGER IF EXISTS {t}" for t in _TRIGGERS), "DROP INDEX IF EXISTS ix_records_fts_hit",
            "DROP TABLE IF EXISTS records_fts_keys", "DELETE FROM records_fts", *_SEQ_KEYED_DDL[1:],
            _SEQ_KEYED_BACKFILL]


def drop_statements(dialect: str) -> list[str]:
    """The SQL that removes the index (downgrade of ``0007_fulltext``)."""
    return {"sqlite": list(SQLITE_DROP), "postgresql": list(PG_DROP)}.get(dialect, [])


# ------------------------------------------------------------------ queries

def terms(q: str) -> list[str]:
    """The words a ranked search looks for: runs of letters and digits of ``q`` in Unicode
    lowercase, each at most ``MAX_TERM_CHARS``, duplicates dropped, at most ``MAX_TERMS``."""
    out: list[str] = []
    for w in WORD.findall(q.lower()):
        w = w[:MAX_TERM_CHARS]
        if w not in out:
            out.append(w)
    return out[:MAX_TERMS]


def sqlite_match(words: Iterable[str], match: str) -> str:
    """The FTS5 MATCH expression: every word as a quoted prefix, in the columns of
    ``match`` (``path``; ``content``: headings and body; ``any``: all three)."""
    body = " AND ".join(f'"{w}"*' for w in words)  # words hold letters and digits only
    cols = {"path": "{path}", "content": "{headings body}", "any": "{path headings body}"}[match]
    return f"{cols} : ({body})"


def pg_tsquery(words: Iterable[str], match: str) -> str:
    """The ``to_tsquery('simple', …)`` text: every word as a prefix, restricted to the
    weights of ``match`` (A: path; B, D: headings and body)."""
    weights = {"path": "A", "content": "BD", "any": ""}[match]
    return " & ".join(f"'{w}':*{weights}" for w in words)


class Matcher:
    """Where the words of a ranked search are in a text, by the index's rule (a word of
    the text that starts with one of ``words``, any case): one compiled pattern."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self._re = re.compile(r"(?<![^\W_])(?:" + "|".join(map(re.escape, sorted(words, key=len, reverse=True)))
                              + ")")

    def line(self, line: str) -> bool:
        """Whether ``line`` holds one of the words."""
        low = line.lower()
        # the plain substring test first (C speed): most lines hold none of the words
        return any(w in low for w in self.words) and self._re.search(low) is not None

    def count(self, line: str) -> int:
        """How many of the words ``line`` holds (each counted once)."""
        low = line.lower()
        return sum(1 for w in self.words if w in low and re.search(r"(?<![^\W_])" + re.escape(w), low))

    def path(self, path: str) -> bool:
        """Whether ``path`` holds every word."""
        low = path.lower()
        return all(re.search(r"(?<![^\W_])" + re.escape(w), low) for w in self.words)


SNIPPET_CHARS = 200


def snippet(content: str, m: Matcher, path_hit: bool) -> str:
    """A short excerpt of ``content`` (at most ``SNIPPET_CHARS`` characters, `` … `` where
    cut) around the first line holding the most of the words; the first non-blank line
    when none does (a hit by its path). Plain text, never markup: content is untrusted."""
    lines = content.split("\n")
    best, best_n = 0, 0
    for i, line in enumerate(lines):
        n = m.count(line)
        if n > best_n:
            best, best_n = i, n
            if n == len(m.words):
                break
    if best_n == 0 and path_hit:
        best = next((i for i, ln in enumerate(lines) if ln.strip()), 0)
    line = lines[best].strip() if lines else ""
    if len(line) <= SNIPPET_CHARS:
        return line
    low = line.lower()
    pos = min((p for p in (low.find(w) for w in m.words) if p >= 0), default=0)
    start = max(0, min(pos - SNIPPET_CHARS // 4, len(line) - SNIPPET_CHARS))
    out = line[start:start + SNIPPET_CHARS]
    return ("… " if start else "") + out + (" …" if start + SNIPPET_CHARS < len(line) else "")
