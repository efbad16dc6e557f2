# Removing: files, empty and non-empty directories, and what fails.
mkdir -p d/e
echo x > d/e/x.md
rmdir d; echo "rmdir non-empty: $?"
rm d/e/x.md
rmdir d/e d; echo "rmdir empty: $?"
rm missing.md 2>/dev/null; echo "rm missing: $?"
ls -A
