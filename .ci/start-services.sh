#!/usr/bin/env bash
# Start the services the tests need, on loopback only:
#   - Docker Engine (dockerd) with its data root under $STOKER_SERVICES_DIR, no bridge/iptables
#   - a container registry (Debian's docker-registry) on 127.0.0.1:5000
#   - (installed, not started) headless Chromium and its driver for tests/ui_check.py
# Installs Debian's docker.io and docker-registry first if missing (needs root and apt).
# Idempotent: reuses an engine/registry that already answers. Prints the env to export.
set -euo pipefail
dir=${STOKER_SERVICES_DIR:-/tmp/stoker-services}
mkdir -p "$dir"

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-registry >/dev/null 2>&1 || need+=(docker-registry)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v busybox >/dev/null 2>&1 || need+=(busybox-static)
# Headless Chromium for tests/ui_check.py (the MLflow and Prefect pages of one run): ~16 s.
browser=()
command -v chromium >/dev/null 2>&1 || browser+=(chromium)
command -v chromedriver >/dev/null 2>&1 || browser+=(chromium-driver)
if [ ${#need[@]} -gt 0 ] || [ ${#browser[@]} -gt 0 ]; then
  echo "installing ${need[*]} ${browser[*]}" >&2
  apt-get update -qq
fi
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ ${#browser[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${browser[@]}" \
    >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd (data root $dir/docker)" >&2
  # dockerd refuses to start while its pid file names a live process: one left by an engine that
  # is gone (a reboot, a machine started from a copy of this /tmp) may name another program now.
  if [ -f "$dir/dockerd.pid" ] && \
     [ "$(cat "/proc/$(cat "$dir/dockerd.pid" 2>/dev/null)/comm" 2>/dev/null)" != dockerd ]; then
    rm -f "$dir/dockerd.pid"
  fi
  nohup dockerd --bridge=none --iptables=false --ip6tables=false \
    --data-root "$dir/docker" --exec-root "$dir/docker-exec" \
    --pidfile "$dir/dockerd.pid" -H unix:///var/run/docker.sock \
    >"$dir/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { cat "$dir/dockerd.log" >&2; exit 1; }
fi

if ! curl -fsS http://127.0.0.1:5000/v2/ >/dev/null 2>&1; then
  echo "starting registry on 127.0.0.1:5000" >&2
  cat >"$dir/registry.yml" <<YAML
version: 0.1
storage:
  filesystem:
    rootdirectory: $dir/registry
  delete:
    enabled: true
http:
  addr: 127.0.0.1:5000
YAML
  nohup docker-registry serve "$dir/registry.yml" >"$dir/registry.log" 2>&1 &
  for _ in $(seq 1 30); do curl -fsS http://127.0.0.1:5000/v2/ >/dev/null 2>&1 && break; sleep 1; done
  curl -fsS http://127.0.0.1:5000/v2/ >/dev/null || { cat "$dir/registry.log" >&2; exit 1; }
fi
echo "docker and registry (127.0.0.1:5000) are up" >&2
