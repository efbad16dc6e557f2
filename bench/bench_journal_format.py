"""What one durable outbox entry costs on this disk, by storage format (bench/README.md, "Priced
in session 25"): N entries of 2 KB, each made durable before the next, with the previous entry's
removal in the same write. ``sqlite``: the outbox journal's own shape (SQLite, WAL,
``synchronous=FULL``, one transaction an entry); ``append``: an append-only segment (one ``pwrite``
of a length + CRC32 framed record and the previous entry's tombstone, one ``fdatasync``);
``append_prealloc``: the same into a preallocated file. Prints wall and CPU µs per entry, twice.
``python bench/bench_journal_format.py DIR [N]`` (DIR on the disk to measure; files are replaced).
"""
import os
import resource
import sqlite3
import struct
import sys
import time
import zlib

d = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
os.makedirs(d, exist_ok=True)
payload = os.urandom(1024).hex().encode()[:2048]

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime

def bench_sqlite():
    p = os.path.join(d, "j.db")
    for f in (p, p+"-wal", p+"-shm"):
        if os.path.exists(f): os.unlink(f)
    db = sqlite3.connect(p, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL"); db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE entries (id INTEGER PRIMARY KEY, store TEXT, op TEXT, node_key TEXT, args TEXT, content BLOB, sha TEXT)")
    t0, c0 = time.perf_counter(), cpu()
    for i in range(N):
        db.execute("BEGIN")
        if i: db.execute("DELETE FROM entries WHERE id=?", (i-1,))
        db.execute("INSERT INTO entries VALUES (?,?,?,?,?,?,?)", (i, "default", "put", f"n:{i}", '{"path":"f%d.md"}' % i, payload, "ab"*32))
        db.execute("COMMIT")
    return (time.perf_counter()-t0)/N*1e6, (cpu()-c0)/N*1e6

def bench_append():
    p = os.path.join(d, "j.seg")
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    off = 0
    t0, c0 = time.perf_counter(), cpu()
    for i in range(N):
        body = b'{"id":%d,"store":"default","op":"put","key":"n:%d","path":"f%d.md"}\n' % (i, i, i) + payload
        rec = struct.pack("<II", len(body), zlib.crc32(body)) + body
        if i:  # the previous entry's tombstone rides with this record
            tomb = b'{"done":%d}' % (i-1)
            rec = struct.pack("<II", len(tomb), zlib.crc32(tomb)) + tomb + rec
        os.pwrite(fd, rec, off); off += len(rec)
        os.fdatasync(fd)
    os.close(fd)
    return (time.perf_counter()-t0)/N*1e6, (cpu()-c0)/N*1e6

def bench_append_prealloc():
    p = os.path.join(d, "j2.seg")
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, 64 << 20)
    os.fsync(fd)
    off = 0
    t0, c0 = time.perf_counter(), cpu()
    for i in range(N):
        body = b'{"id":%d,"store":"default","op":"put","key":"n:%d","path":"f%d.md"}\n' % (i, i, i) + payload
        rec = struct.pack("<II", len(body), zlib.crc32(body)) + body
        os.pwrite(fd, rec, off); off += len(rec)
        os.fdatasync(fd)
    os.close(fd)
    return (time.perf_counter()-t0)/N*1e6, (cpu()-c0)/N*1e6

for _ in range(2):
    for name, f in (("sqlite", bench_sqlite), ("append", bench_append), ("append_prealloc", bench_append_prealloc)):
        w, c = f()
        print(f"{name:16s} wall {w:7.1f} us/op  cpu {c:6.1f} us/op")
