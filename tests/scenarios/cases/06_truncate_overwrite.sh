# Overwrite a longer file with a shorter one, truncate, then empty it. (Extending with
# truncate would add NUL bytes, which records refuse: memory is text.)
set -e
echo "a much longer first version" > f.md
echo short > f.md
cat f.md
truncate -s 3 f.md
od -c f.md
: > f.md
wc -c f.md
