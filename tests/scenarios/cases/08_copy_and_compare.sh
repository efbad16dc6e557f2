# cp a file and a tree; cmp and diff agree.
set -e
mkdir -p src/sub
printf 'line 1\nline 2\n' > src/sub/a.md
cp -r src dst
cp src/sub/a.md copy.md
cmp src/sub/a.md copy.md && echo same
echo changed >> copy.md
diff src/sub/a.md copy.md || echo "diff exit $?"
find . -type f | sort
