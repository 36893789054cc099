#!/usr/bin/env bash
# Install the system tools the tests and benchmarks use, on Debian/Ubuntu, as root.
#
#   redis-server, redis-cli  (packages redis-server, redis-tools): real-Redis test fixtures
#   wrk                      (package wrk): HTTP/1.1 load
#   h2load, nghttp           (package nghttp2-client): HTTP/2 load
#   buildah, mmdebstrap      (packages buildah, mmdebstrap): tests/image builds the Containerfile
#                            on a local Debian base, offline (about 1 min to install; set
#                            EXTAUTHZ_SKIP_IMAGE_TOOLS=1 to leave them out, the test then skips)
#
# Idempotent and non-interactive: installs only what `command -v` cannot find, runs
# `apt-get update` once and only if something is missing. Never starts Redis as a service
# (the tests start their own throwaway processes): a temporary /usr/sbin/policy-rc.d
# forbids service starts during the install.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

# command -> Debian package
declare -A PACKAGE_FOR=(
  [redis-server]=redis-server
  [redis-cli]=redis-tools
  [wrk]=wrk
  [h2load]=nghttp2-client
  [nghttp]=nghttp2-client
  [buildah]=buildah
  [mmdebstrap]=mmdebstrap
)
ORDER=(redis-server redis-cli wrk h2load nghttp)
if [[ ${EXTAUTHZ_SKIP_IMAGE_TOOLS:-0} != 1 ]]; then
  ORDER+=(buildah mmdebstrap)
fi

missing=()
for cmd in "${ORDER[@]}"; do
  pkg=${PACKAGE_FOR[$cmd]}
  if command -v "$cmd" >/dev/null 2>&1; then
    echo "ok       $cmd ($(command -v "$cmd"))"
  elif [[ " ${missing[*]} " != *" $pkg "* ]]; then
    echo "missing  $cmd -> will install $pkg"
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "nothing to install"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  echo "error: installing ${missing[*]} needs root (run: sudo $0)" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: apt-get not found; install ${missing[*]} with your package manager" >&2
  exit 1
fi

policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\n# added by install-system-deps.sh while installing\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  trap 'rm -f "$policy"' EXIT
fi

echo "apt-get update"
apt-get update -qq
echo "apt-get install ${missing[*]}"
apt-get install -y -qq --no-install-recommends \
  -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
  "${missing[@]}"

status=0
for cmd in "${ORDER[@]}"; do
  if command -v "$cmd" >/dev/null 2>&1; then
    echo "ok       $cmd ($(command -v "$cmd"))"
  else
    echo "error: $cmd still missing after installing ${PACKAGE_FOR[$cmd]}" >&2
    status=1
  fi
done
exit $status
