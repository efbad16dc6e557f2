# Non-ASCII names and content, spaces in names.
set -e
mkdir -p "Café notes"
printf 'naïve façade — ok\n' > "Café notes/résumé 1.md"
ls "Café notes"
cat "Café notes/résumé 1.md"
mv "Café notes/résumé 1.md" "Café notes/日本語.md"
ls "Café notes"
