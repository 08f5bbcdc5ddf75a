#!/usr/bin/env bash
# System packages TierFS needs, installed with apt-get only when missing.
# Idempotent and quiet when everything is present.
set -euo pipefail

need=()
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
python3 -c 'import sysconfig,os,sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"],"Python.h")) else 1)' \
  2>/dev/null || need+=(python3-dev)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
# FUSE: the POSIX mount and the power-loss simulator used by the tests.
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need+=(libfuse3-dev)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-system: need root to apt-get install ${need[*]}" >&2
    exit 1
  fi
  echo "install-system: apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
