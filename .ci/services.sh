#!/usr/bin/env bash
# Make sure the machine's services that the tests use are running, before the tests:
#   Postgres 15+ on 127.0.0.1:$_hs_pg_port, user postgres with trust auth over TCP from loopback;
#   Redis on 127.0.0.1:$_hs_redis_port answering PING;
#   RabbitMQ started if it is installed and not answering (never installed here).
# Installs Postgres / Redis with apt-get when they are missing. Prints one line per service.
# Idempotent, and quick when everything is up. Call it (bash .ci/services.sh) or source it;
# either way it does not change the caller's shell options, and its status is 0 when the
# required services are up. HARVEST_CI_PG_PORT / HARVEST_CI_REDIS_PORT override the ports
# (to exercise this script against other servers; CI uses the defaults).

_hs_pg_port=${HARVEST_CI_PG_PORT:-5432}
_hs_redis_port=${HARVEST_CI_REDIS_PORT:-6379}

_hs_say() { printf '%s\n' "$*"; }

_hs_root() {
    if [[ $EUID -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

_hs_as_postgres() {
    if [[ $EUID -eq 0 ]]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
}

_hs_wait() { # _hs_wait SECONDS COMMAND...: retry COMMAND until it succeeds or time runs out
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

_hs_tcp_open() { # _hs_tcp_open PORT
    timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

_hs_apt_install() {
    _hs_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    _hs_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- Postgres --------------------------------------------------------------------------------

_hs_pg_ready() { pg_isready -q -h 127.0.0.1 -p "$_hs_pg_port" -t 2 >/dev/null 2>&1; }

_hs_pg_trust_ok() { # connects as postgres over TCP with no password at all
    PGPASSWORD='' PGPASSFILE=/dev/null PGCONNECT_TIMEOUT=5 \
        psql -w -X -q -h 127.0.0.1 -p "$_hs_pg_port" -U postgres -d postgres -tAc 'select 1' \
        >/dev/null 2>&1
}

_hs_pg_version() { ls /etc/postgresql 2>/dev/null | sort -V | tail -1; }

_hs_pg_start_cluster() {
    local ver
    ver=$(_hs_pg_version)
    if [[ -z $ver ]]; then
        _hs_say "postgres: FAILED: no cluster under /etc/postgresql after install" >&2
        return 1
    fi
    if [[ ! -d /etc/postgresql/$ver/main ]]; then
        _hs_root pg_createcluster "$ver" main >/dev/null
    fi
    _hs_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start 2>/dev/null || true
    if ! _hs_wait 30 _hs_pg_ready; then
        _hs_say "postgres: FAILED: cluster $ver/main is not ready on 127.0.0.1:$_hs_pg_port after 30s" \
            "($(pg_lsclusters --no-header 2>/dev/null | tr -s ' ' | tr '\n' ';'))" >&2
        return 1
    fi
    _hs_pg_action="${_hs_pg_installed:+installed, }started cluster $ver/main"
}

_hs_pg_trust_loopback() { # put trust lines for loopback ahead of the others, then reload
    local hba marker='# harvest CI: trust loopback'
    hba=$(_hs_as_postgres psql -X -p "$_hs_pg_port" -tAc 'show hba_file' 2>/dev/null) || hba=""
    [[ -n $hba ]] || return 1
    if ! _hs_root grep -qF "$marker" "$hba"; then
        {
            printf '%s\n' "$marker" \
                'host all all 127.0.0.1/32 trust' \
                'host all all ::1/128 trust'
            _hs_root cat "$hba"
        } >"/tmp/harvest-pg_hba.$$"
        _hs_root sh -c "cat '/tmp/harvest-pg_hba.$$' > '$hba'"
        rm -f "/tmp/harvest-pg_hba.$$"
    fi
    _hs_as_postgres psql -X -q -p "$_hs_pg_port" -tAc 'select pg_reload_conf()' >/dev/null 2>&1 ||
        _hs_root pg_ctlcluster --skip-systemctl-redirect "$(_hs_pg_version)" main reload
    _hs_wait 10 _hs_pg_trust_ok
}

_hs_postgres() {
    _hs_pg_action="already running" _hs_pg_installed=""
    if ! command -v pg_ctlcluster >/dev/null 2>&1 || [[ -z $(_hs_pg_version) ]]; then
        if ! _hs_apt_install postgresql; then
            _hs_say "postgres: FAILED: apt-get install postgresql" >&2
            return 1
        fi
        _hs_pg_action="installed" _hs_pg_installed=1
    fi
    if ! _hs_pg_ready; then
        _hs_pg_start_cluster || return 1
    fi
    local auth="trust ok"
    if ! _hs_pg_trust_ok; then
        if ! _hs_pg_trust_loopback; then
            _hs_say "postgres: FAILED: user postgres cannot connect to 127.0.0.1:$_hs_pg_port" \
                "without a password, even after adding trust lines to pg_hba.conf" >&2
            return 1
        fi
        auth="trust lines added to pg_hba.conf"
    fi
    local num
    num=$(PGPASSFILE=/dev/null psql -w -X -h 127.0.0.1 -p "$_hs_pg_port" -U postgres -d postgres \
        -tAc 'show server_version_num' 2>/dev/null)
    if [[ -z $num ]] || ((num < 150000)); then
        _hs_say "postgres: FAILED: server version ${num:-unknown} on 127.0.0.1:$_hs_pg_port, need 15+" >&2
        return 1
    fi
    _hs_say "postgres: $_hs_pg_action, version $((num / 10000)) on 127.0.0.1:$_hs_pg_port, $auth"
}

# --- Redis -----------------------------------------------------------------------------------

_hs_redis_ping() {
    local reply
    if command -v redis-cli >/dev/null 2>&1; then
        reply=$(timeout 5 redis-cli -h 127.0.0.1 -p "$_hs_redis_port" ping 2>/dev/null) || reply=""
    else
        reply=$(timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/$1 &&
            printf "PING\r\n" >&3 && IFS= read -r line <&3 && printf "%s" "$line"' \
            _ "$_hs_redis_port" 2>/dev/null) || reply=""
    fi
    [[ $reply == *PONG* ]]
}

_hs_redis() {
    if _hs_redis_ping; then
        _hs_say "redis: already running on 127.0.0.1:$_hs_redis_port"
        return 0
    fi
    local action="started"
    if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
        if ! _hs_apt_install redis-server redis-tools; then
            _hs_say "redis: FAILED: apt-get install redis-server redis-tools" >&2
            return 1
        fi
        action="installed and started"
        if _hs_redis_ping; then # the package's own service may have started it
            _hs_say "redis: installed, running on 127.0.0.1:$_hs_redis_port"
            return 0
        fi
    fi
    _hs_root mkdir -p /var/lib/redis /var/log/redis
    local args=(--daemonize yes --port "$_hs_redis_port" --save "" --appendonly no
        --dir /var/lib/redis --logfile /var/log/redis/ci.log)
    _hs_root redis-server "${args[@]}" --bind 127.0.0.1 -::1 >/dev/null 2>&1 ||
        _hs_root redis-server "${args[@]}" --bind 127.0.0.1 >/dev/null 2>&1 || true
    if ! _hs_wait 30 _hs_redis_ping; then
        _hs_say "redis: FAILED: no PONG from 127.0.0.1:$_hs_redis_port after 30s" \
            "(see /var/log/redis/ci.log)" >&2
        return 1
    fi
    _hs_say "redis: $action on 127.0.0.1:$_hs_redis_port"
}

# --- RabbitMQ (optional) ---------------------------------------------------------------------

_hs_rabbitmq() {
    if ! command -v rabbitmq-server >/dev/null 2>&1; then
        _hs_say "rabbitmq: not installed, skipped"
        return 0
    fi
    if _hs_tcp_open 5672; then
        _hs_say "rabbitmq: already running on 127.0.0.1:5672"
        return 0
    fi
    _hs_root rabbitmq-server -detached >/dev/null 2>&1 || true
    if _hs_wait 60 _hs_tcp_open 5672; then
        _hs_say "rabbitmq: started on 127.0.0.1:5672"
    else
        _hs_say "rabbitmq: WARNING: started but port 5672 not open after 60s" \
            "(tests marked rabbitmq will fail)" >&2
    fi
}

_hs_main() {
    local status=0
    _hs_postgres || status=1
    _hs_redis || status=1
    _hs_rabbitmq
    return $status
}

if (return 0 2>/dev/null); then
    (set -uo pipefail && _hs_main "$@")
else
    set -uo pipefail
    _hs_main "$@"
fi
