# A journal grows by appends from several commands.
set -e
for i in 1 2 3 4 5; do echo "entry $i" >> log.md; done
printf 'no newline' >> log.md
echo >> log.md
tail -n 3 log.md
wc -l log.md
