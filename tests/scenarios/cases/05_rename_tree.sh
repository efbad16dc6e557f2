# Move files and whole directories around, then list what is where.
set -e
mkdir -p a/b
echo one > a/b/one.md
echo two > a/two.md
mv a/two.md a/b/
mv a renamed
mv renamed/b/one.md renamed/first.md
find . | sort
cat renamed/first.md renamed/b/two.md
