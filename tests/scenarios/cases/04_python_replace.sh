# Python writes a temporary file, fsyncs it and os.replace()s it over the original.
set -e
echo old > facts.md
python3 - <<'PY'
import os, tempfile
fd, tmp = tempfile.mkstemp(dir=".", prefix=".facts-")
with os.fdopen(fd, "w") as f:
    f.write("new facts\n")
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, "facts.md")
print(open("facts.md").read(), end="")
print(sorted(os.listdir(".")))
PY
