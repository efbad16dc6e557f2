# expect-exit: 0
# expect-stdout: bash >: refused: Operation not permitted\nbash NUL: refused: Invalid or incomplete multibyte or wide character\nbash not UTF-8: refused: Invalid or incomplete multibyte or wide character\nbash type: refused: Invalid argument\nbash >>: refused: Operation not permitted; kept\nsh >: refused\nsh >>: refused; kept\npython: refused EPERM\npython 4-byte character in two writes: ok\npython secret in two writes: first ok, second EPERM\npython NUL: EILSEQ\ntee: refused: tee: tee.md: Operation not permitted\ncat >>: refused: cat: write error: Operation not permitted; kept\nsed -i: refused 4; kept\nvim: refused 1; record kept; state rejected\nerrors.log: 14 lines for this case\n
# memfuse refuses at write(2) what it can decide from the bytes it holds (docs/SEMANTICS.md
# "Refusals at write(2)"): a shell sees it in the exit status and on stderr; a local disk
# would take these writes.
set -u
export LC_ALL=C.UTF-8
rnd() { head -c 600 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c "$1"; }
gh="gh""p_$(rnd 36)"                       # a GitHub token's shape, made here
aws="$(rnd 40)"
sk="s""k_live_$(rnd 24)"
log=$(cd .. && while [ ! -d .memfuse ] && [ "$PWD" != / ]; do cd ..; done; echo "$PWD/.memfuse/errors.log")
here=$(basename "$(dirname "$PWD")")/$(basename "$PWD")
before=$(grep -c "$here/" "$log")

refused() {  # LABEL WANT-STDERR COMMAND...: the command fails and stderr names the errno
  local label=$1 want=$2; shift 2
  local err st
  err=$("$@" 2>&1 >/dev/null); st=$?
  if [ $st -ne 0 ] && [[ "$err" == *"$want"* ]]; then echo "$label: refused: $want"
  else echo "$label: NOT refused (exit $st: $err)"; fi
}
kept() { cmp -s "$1" "$2" && echo "; kept" || echo "; CHANGED"; }

refused "bash >" "Operation not permitted" bash -c "echo \"aws_secret_access_key = $aws\" > k.md"
refused "bash NUL" "Invalid or incomplete multibyte or wide character" bash -c "printf 'a\0b\n' > n.md"
refused "bash not UTF-8" "Invalid or incomplete multibyte or wide character" bash -c "printf '\xff\xfe\n' > u.md"
refused "bash type" "Invalid argument" bash -c "printf -- '---\ntype: notes\n---\nbody\n' > t.md"
echo "a line" > ok.md; cp ok.md /tmp/ok.$$
printf '%s' "$(refused "bash >>" "Operation not permitted" bash -c "echo 'api_key=$sk' >> ok.md")"; kept ok.md /tmp/ok.$$
sh -c "echo 'token $gh' > s.md" 2>/dev/null && echo "sh >: NOT refused" || echo "sh >: refused"
sh -c "echo 'token $gh' >> ok.md" 2>/dev/null && printf 'sh >>: NOT refused' || printf 'sh >>: refused'; kept ok.md /tmp/ok.$$

python3 - "$gh" <<'PY'
import errno, os, sys
g = sys.argv[1]
try:
    with open("p.md", "w") as f:
        f.write("token " + g + "\n")
    print("python: NOT refused")
except OSError as e:
    print("python: refused", errno.errorcode[e.errno])
fd = os.open("c.md", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
ch = "😀".encode()
os.write(fd, b"x" + ch[:2]); os.write(fd, ch[2:] + b"\n")
print("python 4-byte character in two writes:", "ok" if open("c.md", "rb").read() == b"x" + ch + b"\n" else "BAD")
os.write(fd, ("t " + g[:20]).encode())
try:
    os.write(fd, (g[20:] + "\n").encode())
    print("python secret in two writes: NOT refused")
except OSError as e:
    print("python secret in two writes: first ok, second", errno.errorcode[e.errno])
try:
    os.write(fd, b"a\0")
except OSError as e:
    print("python NUL:", errno.errorcode[e.errno])
try:
    os.close(fd)
except OSError:
    pass
PY

out=$(echo "token $gh" | tee tee.md 2>&1 >/dev/null); st=$?
[ $st -ne 0 ] && echo "tee: refused: $out" || echo "tee: NOT refused"
printf 'token %s\n' "$gh" > /tmp/secret.$$
printf '%s' "$(refused "cat >>" "cat: write error: Operation not permitted" bash -c "cat /tmp/secret.$$ >> ok.md")"; kept ok.md /tmp/ok.$$

echo "line PLACEHOLDER" > sd.md; cp sd.md /tmp/sd.$$
sed -i "s/PLACEHOLDER/$gh/" sd.md 2>/dev/null; printf 'sed -i: refused %s' $?; kept sd.md /tmp/sd.$$

echo "first" > v.md
v0=$(getfattr --only-values -n user.memfuse.version v.md 2>/dev/null)
vim -n -es -c "normal Gotoken $gh" -c wq v.md </dev/null >/dev/null 2>&1; st=$?
v1=$(getfattr --only-values -n user.memfuse.version v.md 2>/dev/null)
state=$(getfattr --only-values -n user.memfuse.state v.md 2>/dev/null)
echo "vim: refused $st; record $([ "$v0" = "$v1" ] && echo kept || echo "CHANGED $v0 $v1"); state $state"

rm -f /tmp/ok.$$ /tmp/sd.$$ /tmp/secret.$$
echo "errors.log: $(( $(grep -c "$here/" "$log") - before )) lines for this case"
