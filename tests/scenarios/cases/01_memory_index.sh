# An agent keeps a MEMORY.md index and topic files, then reads them back.
set -e
mkdir -p topics
printf '# Memory\n- [build](topics/build.md): how to build\n' > MEMORY.md
cat > topics/build.md <<'MD'
---
type: project
---
Run `make` then `make test`.
MD
cat MEMORY.md topics/build.md
wc -c MEMORY.md topics/build.md
