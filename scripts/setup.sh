#!/usr/bin/env bash
# Installs what building and testing tsd needs on a fresh Debian 12 machine: Debian packages with
# apt-get (needs root), and the Python packages into .venv/ at the repository root.
# Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS=(build-essential cmake ninja-build pkg-config git
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
      libspdlog-dev libfmt-dev libtomlplusplus-dev libcli11-dev nlohmann-json3-dev
      libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev libnuma-dev prometheus-cpp-dev
      libsystemd-dev python3-venv
      clang  # Debian's clang-14: scripts/check-thread-safety.sh (the thread-safety analysis)
      libclang-rt-14-dev  # compiler-rt's libFuzzer, ASan and UBSan for clang: scripts/fuzz.sh
      systemd file dpkg-dev adduser)  # the package test: systemd-analyze, cpack's dpkg-shlibdeps

missing=()
for p in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -r requirements-dev.txt
# TRL (trainstream.integrations.trl, tests/python/test_trl.py): 1.16.0 works with transformers 5.17.0
# and torch 2.11 (datasets pinned at the version tested with it). MkDocs builds the documentation site (mkdocs.yml; `mkdocs build --strict`).
.venv/bin/python -m pip install -q trl==1.16.0 datasets==5.2.0 mkdocs==1.6.1
# tsd, tsctl, the C++ suites and libraries, built once into build/ (scripts/build.sh, which the
# test and run scripts call again: then nothing is left to do).
echo "setup: building tsd into build/"
scripts/build.sh >/dev/null
# The trainstream package (client-py/): its extension is built against the torch just installed,
# and links the tsclient of that same build/ (TSD_PY_BUILD_DIR), so nothing is compiled twice.
echo "setup: building the trainstream Python package"
TSD_PY_BUILD_DIR="$PWD/build" .venv/bin/python -m pip install -q --no-build-isolation ./client-py
echo "setup: done"
