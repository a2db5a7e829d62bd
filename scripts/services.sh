#!/usr/bin/env bash
# The services the tests use, on 127.0.0.1 (idempotent; scripts/test.sh runs it before cargo test):
# - PostgreSQL on 5432, user `postgres` with trust auth for 127.0.0.1 (the ledger's store suite);
# - Redis on 6379 (scale-out tests).
# Each is left alone when it already answers; else started when installed; else installed with
# apt-get (root or sudo) and started. Then waited for, at most SPINE_SERVICES_WAIT_S seconds (30).
# With SPINE_TEST_PG_URL set, PostgreSQL is yours to provide and is not touched.
# SPINE_REDIS_PORT (default 6379) moves the Redis this script checks/starts to another port (a
# throwaway one, to try this script without touching a Redis that is running).
set -euo pipefail

WAIT_S="${SPINE_SERVICES_WAIT_S:-30}"
REDIS_PORT="${SPINE_REDIS_PORT:-6379}"
log() { echo "[services] $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo -n "$@"
  else
    log "need root (or sudo) to run: $*"
    return 1
  fi
}

apt_updated=0
apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    log "apt-get not found: install $* yourself"
    return 1
  fi
  if [ "$apt_updated" -eq 0 ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() { # name, command...
  local name=$1
  shift
  local deadline=$(($(date +%s) + WAIT_S))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "$name not reachable after ${WAIT_S}s"
      return 1
    fi
    sleep 0.5
  done
}

wait_briefly() { # command... : up to 3 s
  local i
  for i in 1 2 3 4 5 6; do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  return 1
}

pg_answers() { psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -Atqc 'SELECT 1' >/dev/null 2>&1; }

pg_cluster_version() { ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1; }

pg_trust_localhost() {
  local version hba
  version=$(pg_cluster_version)
  hba="/etc/postgresql/$version/main/pg_hba.conf"
  [ -n "$version" ] && [ -f "$hba" ] || return 1
  if ! grep -Eq '^host[[:space:]]+all[[:space:]]+postgres[[:space:]]+127\.0\.0\.1/32[[:space:]]+trust' "$hba"; then
    log "pg_hba.conf: trust for postgres@127.0.0.1"
    as_root sed -i '1i host all postgres 127.0.0.1/32 trust' "$hba"
  fi
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload || true
}

start_postgres() {
  if [ -n "${SPINE_TEST_PG_URL:-}" ]; then
    log "SPINE_TEST_PG_URL is set: PostgreSQL not managed here"
    return 0
  fi
  if pg_answers; then
    log "PostgreSQL: up"
    return 0
  fi
  if [ -z "$(pg_cluster_version)" ] || ! command -v pg_ctlcluster >/dev/null 2>&1; then
    log "PostgreSQL: installing (apt-get install postgresql)"
    apt_install postgresql
  fi
  local version
  version=$(pg_cluster_version)
  if [ -z "$version" ]; then
    log "PostgreSQL: no cluster under /etc/postgresql after install"
    return 1
  fi
  if ! port_open 5432; then
    log "PostgreSQL: starting cluster $version/main"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  fi
  wait_for "PostgreSQL port 5432" port_open 5432
  if ! pg_answers; then
    pg_trust_localhost || true
  fi
  wait_for "PostgreSQL (psql -h 127.0.0.1 -U postgres)" pg_answers
  log "PostgreSQL: up"
}

redis_answers() {
  if command -v redis-cli >/dev/null 2>&1; then
    [ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
  else
    port_open "$REDIS_PORT"
  fi
}

start_redis() {
  if redis_answers; then
    log "Redis: up on $REDIS_PORT"
    return 0
  fi
  if port_open "$REDIS_PORT"; then
    # something listens but does not answer PING with PONG (not Redis, or it wants AUTH):
    # starting another server on the same port could only fail
    log "Redis: port $REDIS_PORT is taken by something that does not answer PING; free it or set SPINE_REDIS_PORT"
    return 1
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    log "Redis: installing (apt-get install redis-server)"
    apt_install redis-server
    hash -r
    if ! command -v redis-server >/dev/null 2>&1; then
      log "Redis: redis-server not on PATH after install"
      return 1
    fi
    # the package's service may have started it already (a machine with a service manager)
    if [ "$REDIS_PORT" = 6379 ] && wait_briefly redis_answers; then
      log "Redis: up on $REDIS_PORT (started by the package)"
      return 0
    fi
  fi
  # installed but stopped (no service manager in a container, or never started): start our own,
  # in the background, in memory only (no RDB/AOF files), on 127.0.0.1
  log "Redis: starting redis-server on 127.0.0.1:$REDIS_PORT"
  if ! redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir "${TMPDIR:-/tmp}" >/dev/null; then
    log "Redis: redis-server failed to start"
    return 1
  fi
  wait_for "Redis on $REDIS_PORT" redis_answers
  log "Redis: up on $REDIS_PORT"
}

start_postgres
start_redis
