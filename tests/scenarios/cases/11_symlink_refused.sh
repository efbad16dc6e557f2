# expect-exit: 0
# expect-stdout: symlink refused\n
# memfuse has no symbolic links (EPERM); a local disk would allow one.
echo x > target.md
if ln -s target.md link.md 2>/dev/null; then echo "symlink made"; else echo "symlink refused"; fi
