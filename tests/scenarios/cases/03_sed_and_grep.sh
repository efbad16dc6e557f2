# Edit in place with sed, search with grep -rn.
set -e
mkdir -p notes
printf 'colour: red\nsize: big\n' > notes/a.md
printf 'colour: blue\n' > notes/b.md
sed -i 's/colour/color/' notes/a.md notes/b.md
grep -rn color . | sort
grep -rc big notes | sort
