# Multi-line content written with a heredoc, read with head / tail / awk.
set -e
cat > plan.md <<'MD'
1. read the logs
2. find the bug
3. write the fix
4. add a test
MD
head -n 2 plan.md
tail -n 1 plan.md
awk 'NR % 2 == 0' plan.md
