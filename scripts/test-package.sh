#!/usr/bin/env bash
# Tests the Debian package end to end on this machine: builds it from build/ with CPack (reusing
# the build; nothing is recompiled when it is up to date), installs it with dpkg, checks what it
# installed (programs, the tsd user and group, the unit as `systemd-analyze verify` sees it, the
# config, headers and library through pkg-config), runs the installed daemon the way the unit
# does (user tsd, a 0750 runtime directory, LimitMEMLOCK=infinity) to check that a member of the
# group tsd may attach and another user may not, then removes and purges the package and checks
# that none of its files is left. Needs root; does not need systemd running as PID 1.
#   scripts/test-package.sh            uses build/
#   scripts/test-package.sh --fresh    also installs it into a minimal Debian 12 made with
#                                      debootstrap (kept in build/fresh-debian12), where only
#                                      Debian's packages are present, and runs it there
set -euo pipefail
cd "$(dirname "$0")/.."
fresh=0
[ "${1:-}" = "--fresh" ] && fresh=1

say() { echo "test-package: $*"; }
fail() {
  echo "test-package: FAILED: $*" >&2
  exit 1
}

[ "$(id -u)" -eq 0 ] || fail "needs root (it installs the package with dpkg)"
if dpkg-query -W -f='${Status}' tsd 2>/dev/null | grep -q "ok installed"; then
  fail "a tsd package is installed already; remove it first (dpkg --purge tsd)"
fi

version=$(sed -n 's/^project(tsd VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
arch=$(dpkg --print-architecture)
deb=build/tsd_${version}_${arch}.deb

say "building $deb"
scripts/build.sh >/dev/null
rm -f build/tsd_*.deb
(cd build && cpack -G DEB >/dev/null 2>&1) || (cd build && cpack -G DEB)
[ -f "$deb" ] || fail "cpack did not write $deb"

tmp=$(mktemp -d /tmp/tsd-package-test.XXXXXX)
chmod 0755 "$tmp"
daemon=""
member=tsd-pkgtest-member
outsider=tsd-pkgtest-outsider
cleanup() {
  [ -n "$daemon" ] && kill -KILL "$daemon" 2>/dev/null || true
  dpkg --purge tsd >/dev/null 2>&1 || true
  for u in "$member" "$outsider"; do
    getent passwd "$u" >/dev/null && userdel "$u" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT

say "dpkg -i $deb"
dpkg -i "$deb" >"$tmp/dpkg-install.log" 2>&1 || { cat "$tmp/dpkg-install.log"; fail "dpkg -i"; }
dpkg-query -L tsd >"$tmp/files"

say "programs"
[ "$(tsd --version)" = "tsd $version" ] || fail "tsd --version printed '$(tsd --version)'"
tsctl --help | grep -q "top" || fail "tsctl --help does not list top"
tsctl top --help >/dev/null || fail "tsctl top --help"
tsd --config /etc/tsd/tsd.toml --print-config >"$tmp/print-config" ||
  fail "the shipped tsd.toml does not load"
grep -q "metrics_listen = '127.0.0.1:9464'" "$tmp/print-config" ||
  fail "unexpected defaults: $(cat "$tmp/print-config")"

say "user and group"
getent group tsd >/dev/null || fail "no group tsd"
[ "$(id -gn tsd)" = tsd ] || fail "user tsd's group is $(id -gn tsd)"
[ "$(getent passwd tsd | cut -d: -f7)" = /usr/sbin/nologin ] || fail "user tsd has a login shell"

say "installed files"
for f in /usr/bin/tsd /usr/bin/tsctl /usr/lib/systemd/system/tsd.service /etc/tsd/tsd.toml \
  /etc/profile.d/tsd.sh /usr/include/tsd/client.h /usr/lib/libtsclient.so.0 \
  /usr/lib/pkgconfig/tsclient.pc /usr/share/doc/tsd/deploy.md; do
  [ -e "$f" ] || fail "missing $f"
done
grep -qx /etc/tsd/tsd.toml /var/lib/dpkg/info/tsd.conffiles || fail "tsd.toml is not a conffile"

say "libraries"
# Every library the installed programs load must come from a Debian package (or this one): one
# found elsewhere (e.g. a CUDA toolkit in /usr/local) is missing on a plain Debian 12.
foreign=""
for f in /usr/bin/tsd /usr/bin/tsctl /usr/lib/libtsclient.so.0; do
  while read -r lib path; do
    owner=""
    for p in "$path" "${path#/usr}" "/usr$path"; do
      owner=$(dpkg-query -S "$p" 2>/dev/null | head -1) && [ -n "$owner" ] && break
    done
    [ -n "$owner" ] || foreign="$foreign $f->$lib($path)"
  done < <(ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
done
if [ -n "$foreign" ]; then
  say "FAIL: the package's programs need libraries no Debian package provides (absent on a plain Debian 12):$foreign"
  exit 1
fi

say "systemd-analyze verify"
systemd-analyze verify /usr/lib/systemd/system/tsd.service || fail "systemd-analyze verify"

say "a client built against the installed headers and library"
cat >"$tmp/client.cc" <<'EOF'
#include <cstdio>
#include <cstring>
#include "tsd/client.h"
int main(int argc, char** argv) {
  auto c = tsd::Client::Connect(argc > 1 ? argv[1] : "");
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 1;
  };
  if (!c.ok()) return fail(c.status());
  if (auto s = (*c)->Attach("pkg-test"); !s.ok()) return fail(s);
  auto r = (*c)->Alloc("r", 1 << 20);
  if (!r.ok()) return fail(r.status());
  std::memset((*r)->data(), 7, (*r)->size());
  std::printf("ok %zu\n", (size_t)(*r)->size());
  return 0;
}
EOF
# shellcheck disable=SC2046
g++ -std=c++17 -o "$tmp/client" "$tmp/client.cc" $(pkg-config --cflags --libs tsclient) ||
  fail "cannot build a client with pkg-config tsclient"
chmod 0755 "$tmp/client"

say "the installed daemon, run as the unit runs it"
run="$tmp/run"  # what RuntimeDirectory=tsd makes: owned by tsd:tsd, mode 0750
install -d -o tsd -g tsd -m 0750 "$run"
# LimitMEMLOCK=infinity where this machine allows it (a container may cap the hard limit); the
# pool is small enough to be locked under the usual 8 MiB limit anyway.
pool=$((8 << 20))
(
  ulimit -l unlimited 2>/dev/null || ulimit -l "$(ulimit -Hl)"
  exec setpriv --reuid tsd --regid tsd --init-groups --inh-caps=-all --bounding-set=-all \
    env RUNTIME_DIRECTORY="$run" /usr/bin/tsd --config /etc/tsd/tsd.toml --pool-size "$pool" \
    --metrics-listen 127.0.0.1:0
) 2>"$tmp/tsd.log" &
daemon=$!
sock="$run/tsd.sock"
for _ in $(seq 100); do
  [ -S "$sock" ] && tsctl --socket "$sock" status >/dev/null 2>&1 && break
  sleep 0.1
done
tsctl --socket "$sock" status >/dev/null || {
  cat "$tmp/tsd.log"
  fail "the daemon did not come up"
}
mode=$(stat -c '%a %U %G' "$sock")
[ "$mode" = "660 tsd tsd" ] || fail "the socket is $mode, not 660 tsd tsd"
limit=$(ulimit -Hl)
if [ "$limit" = unlimited ] || [ "$limit" -ge $((pool >> 10)) ]; then
  tsctl --socket "$sock" status --json | grep -q '"locked":true' || fail "the pool is not locked"
fi

useradd --no-create-home --shell /usr/sbin/nologin -G tsd "$member"
useradd --no-create-home --shell /usr/sbin/nologin "$outsider"
as() { local u=$1; shift; setpriv --reuid "$u" --regid "$u" --init-groups "$@"; }
as "$member" tsctl --socket "$sock" status >/dev/null ||
  fail "a member of group tsd cannot reach the daemon"
as "$member" "$tmp/client" "$sock" | grep -q "^ok 1048576$" ||
  fail "a member of group tsd cannot attach"
if as "$outsider" tsctl --socket "$sock" status >"$tmp/outsider.log" 2>&1; then
  fail "a user outside group tsd reached the daemon"
fi
if as "$outsider" "$tmp/client" "$sock" >>"$tmp/outsider.log" 2>&1; then
  fail "a user outside group tsd attached"
fi
grep -qi "permission denied" "$tmp/outsider.log" ||
  fail "the outsider failed otherwise: $(cat "$tmp/outsider.log")"

port=$(sed -n 's/.*metrics=127\.0\.0\.1:0 (port \([0-9]*\)).*/\1/p' "$tmp/tsd.log")
[ -n "$port" ] || fail "no metrics port in the log: $(cat "$tmp/tsd.log")"
exec 3<>"/dev/tcp/127.0.0.1/$port"
printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
grep -q "^tsd_pool_bytes $pool\$" <&3 || fail "/metrics does not show the pool"
exec 3<&-

kill -TERM "$daemon"
rc=0
wait "$daemon" || rc=$?
daemon=""
[ "$rc" -eq 0 ] || { cat "$tmp/tsd.log"; fail "tsd exited $rc on SIGTERM"; }
grep -q "event=stopped" "$tmp/tsd.log" || fail "no event=stopped in the log"

say "dpkg -r, then --purge"
dpkg -r tsd >/dev/null
[ ! -e /usr/bin/tsd ] || fail "/usr/bin/tsd is left after dpkg -r"
[ -e /etc/tsd/tsd.toml ] || fail "dpkg -r removed the conffile"
dpkg --purge tsd >/dev/null
state=$(dpkg-query -W -f='${db:Status-Status}' tsd 2>/dev/null || true)
[ -z "$state" ] || [ "$state" = not-installed ] || fail "dpkg still has tsd as '$state'"
left=""
while read -r f; do
  [ -d "$f" ] && continue
  [ -e "$f" ] || [ -L "$f" ] && left="$left $f"
done <"$tmp/files"
[ -z "$left" ] || fail "left after purge:$left"
[ ! -e /etc/tsd ] || fail "/etc/tsd is left after purge"

if [ "$fresh" = 1 ]; then
  root=build/fresh-debian12
  name=$(basename "$deb")
  if [ ! -x "$root/usr/bin/apt-get" ]; then
    say "debootstrap: a minimal Debian 12 in $root"
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    rm -rf "$root"
    debootstrap --variant=minbase bookworm "$root" >"$tmp/debootstrap.log" 2>&1 ||
      fail "debootstrap: $(tail -3 "$tmp/debootstrap.log")"
  fi
  say "apt install ./$name in a fresh Debian 12"
  cp "$deb" "$root/tmp/$name"
  chroot "$root" sh -c "export DEBIAN_FRONTEND=noninteractive; apt-get purge -y -qq tsd;
    apt-get update -qq && apt-get install -y -qq /tmp/$name" >"$tmp/fresh.log" 2>&1 ||
    fail "$(tail -5 "$tmp/fresh.log")"
  [ "$(chroot "$root" tsd --version)" = "tsd $version" ] || fail "tsd --version in the fresh system"
  chroot "$root" tsctl --help >/dev/null || fail "tsctl --help in the fresh system"
  chroot "$root" sh -c 'tsd --socket /tmp/tsdt/t.sock --pool-size 8MiB --metrics-listen "" & pid=$!
    for _ in $(seq 50); do tsctl --socket /tmp/tsdt/t.sock status >/dev/null 2>&1 && break; sleep 0.1; done
    tsctl --socket /tmp/tsdt/t.sock status; rc=$?; kill -TERM $pid; wait $pid && exit $rc' \
    >"$tmp/fresh-run.log" 2>&1 ||
    fail "tsd and tsctl in the fresh system: $(cat "$tmp/fresh-run.log")"
  chroot "$root" sh -c "DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq tsd" >/dev/null 2>&1
  rm -f "$root/tmp/$name"
fi

say "passed ($deb installs, runs and removes cleanly; the tsd user and group stay, as on Debian)"
