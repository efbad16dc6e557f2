"""``memfuse db upgrade|current``: the control-plane database's schema migrations (Alembic
revisions shipped in the package, see :mod:`memfuse.server.schema`).

Registers the ``db`` group on ``memfuse.cli.common.cli`` when imported.
Errors are one line on stderr and exit status 1 (the kubelet shows it in ``kubectl logs`` of
a migration Job), never a traceback.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from memfuse.cli.common import cli, opt

__all__ = ["db", "database_errors", "open_database", "safe_url"]

_DB_HELP = ("Database URL: sqlite:///path or postgresql://user@host/db (a password is better "
            "given in the URL from a Secret env var). Default: the dev database. A new SQLite "
            "file is created mode 0600, its missing directory mode 0700.")


def safe_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 — a URL SQLAlchemy cannot parse is shown without credentials
        return url.split("@")[-1] if "@" in url else url


def _one_line(err: BaseException) -> str:
    orig = getattr(err, "orig", None)  # a DBAPI error inside SQLAlchemy's wrapper
    return " ".join(str(orig if orig is not None else err).split())


@contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turn what opening the database at ``url`` may raise into a one-line
    ``click.ClickException``: bad URL, missing driver, unreachable database, schema behind,
    an SQLite file or directory that cannot be created."""
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from memfuse.privfile import PrivateFileError
    from memfuse.server.schema import SchemaError

    shown = safe_url(url)
    try:
        yield
    except SchemaError as e:
        raise click.ClickException(str(e)) from None
    except ArgumentError as e:
        raise click.ClickException(f"bad database URL {shown}: {_one_line(e)}") from None
    except ModuleNotFoundError as e:
        raise click.ClickException(_one_line(e)) from None
    except PrivateFileError as e:  # the SQLite file or its directory cannot be created
        raise click.ClickException(_one_line(e)) from None
    except SQLAlchemyError as e:
        raise click.ClickException(f"database {shown} unreachable or failing: {_one_line(e)}") from None


def open_database(url: str | None, schema: str):
    """A ``memfuse.server.db.Database`` on ``url`` (None: the dev database) with ``schema``
    handling (``migrate`` / ``check`` / ``none``); failures as in ``database_errors``."""
    from memfuse.devenv import dev_db_url
    from memfuse.server.db import Database

    url = url or dev_db_url()
    with database_errors(url):
        database = Database(url, schema=schema)
        try:
            with database.engine.connect():  # unreachable: say so now, not as a failed upgrade
                pass
        except BaseException:
            database.dispose()
            raise
        return database


def _db_option(f):
    return click.option("--db", "url", metavar="URL", envvar="MEMFUSE_DB", show_envvar=True, help=_DB_HELP)(f)


@cli.group()
def db() -> None:
    """Schema migrations of the control-plane database (run `upgrade` before new replicas serve)."""


@db.command("upgrade")
@_db_option
@opt("--revision", default="head", show_default=True, metavar="REV", help="Revision to upgrade to.")
@opt("--sql", "as_sql", is_flag=True,
     help="Print the SQL for an empty database of this URL's dialect instead of running it "
     "(for a DBA to review); nothing is connected to.")
def upgrade(url: str | None, revision: str, as_sql: bool) -> None:
    """Upgrade the database to the newest schema revision (safe to run again, and from two
    places at once: a lock serialises them). A database made before migrations existed is
    recognised and stamped first."""
    from memfuse.devenv import dev_db_url
    from memfuse.server import schema

    if as_sql:
        try:
            click.echo(schema.offline_sql(url or dev_db_url(), revision), nl=False)
        except schema.SchemaError as e:
            raise click.ClickException(str(e)) from None
        return
    database = open_database(url, "none")
    try:
        try:
            before, after = schema.upgrade(database, revision)
        except schema.SchemaError as e:
            raise click.ClickException(str(e)) from None
        except Exception as e:  # noqa: BLE001 — a failing revision: rolled back, one line
            raise click.ClickException(f"upgrade failed and was rolled back: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        database.dispose()
    shown = safe_url(url or dev_db_url())
    if before.current == after.current and not before.legacy:
        note = "" if after.known else " (unknown to this memfuse: made by a newer release; left alone)"
        click.echo(f"database {shown}: already at {after.current}{note}")
    elif before.legacy and before.current == after.current:
        click.echo(f"database {shown}: made before migrations; its tables match {after.current}, recorded as such")
    else:
        start = before.current or "empty"
        legacy = " (made before migrations)" if before.legacy else ""
        click.echo(f"database {shown}: upgraded from {start}{legacy} to {after.current}")


@db.command("current")
@_db_option
@opt("--check", is_flag=True, help="Exit 1 unless the database is at the newest revision.")
def current(url: str | None, check: bool) -> None:
    """Print the database's schema revision and the newest one this memfuse knows."""
    from memfuse.devenv import dev_db_url
    from memfuse.server import schema

    database = open_database(url, "none")
    try:
        st = schema.status(database)
    except Exception as e:  # noqa: BLE001
        raise click.ClickException(f"cannot read the schema revision: {_one_line(e)}") from None
    finally:
        database.dispose()
    if st.current is None:
        state = "empty (no memfuse schema)"
    elif not st.known:
        state = f"{st.current} (unknown to this memfuse: made by a newer release)"
    elif st.legacy:
        state = f"no migration history; tables match {st.current}"
    else:
        state = st.current + (" (head)" if st.at_head else "")
    click.echo(f"database {safe_url(url or dev_db_url())}: {state}")
    if not st.at_head:
        click.echo(f"newest revision: {st.head}; run `memfuse db upgrade --db URL`")
        if check:
            raise SystemExit(1)
