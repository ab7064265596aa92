# Shared helpers for dev/up and dev/test. Sourced, not run.

# Run as root, or through sudo when there is one.
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# The newest installed Postgres server's bin directory (empty if none).
pg_bindir() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -n "${WALCAST_PG_BINDIR:-}" ] && d=$WALCAST_PG_BINDIR
  echo "$d"
}

# Install what the stack and the tests need, when missing: Postgres 15 with wal2json,
# nats-server, Node.js (for the realtime-js tests), openssl (test certificates), Python's
# venv (for the chart check).
ensure_system_packages() {
  local need=() bindir
  bindir=$(pg_bindir)
  if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
    need+=(postgresql-15 postgresql-client-15)
    bindir=/usr/lib/postgresql/15/bin
  fi
  if [ ! -f "$bindir/../lib/wal2json.so" ]; then
    local major
    major=$(basename "$(dirname "$bindir")")
    need+=("postgresql-$major-wal2json")
  fi
  command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || need+=(nats-server)
  command -v psql >/dev/null 2>&1 || need+=(postgresql-client)
  command -v node >/dev/null 2>&1 || need+=(nodejs)
  command -v npm >/dev/null 2>&1 || need+=(npm)
  command -v openssl >/dev/null 2>&1 || need+=(openssl)
  # dev/check_chart.py keeps its PyPI packages (helm SDK, Kubernetes schemas) in a venv.
  command -v python3 >/dev/null 2>&1 || need+=(python3)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
  if [ ${#need[@]} -gt 0 ]; then
    echo "installing missing packages: ${need[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
  export PATH="$PATH:/usr/sbin"
}

# Chromium, for the inspector page's browser test (tests/js/inspector.test.js; driven by
# puppeteer-core, which downloads no browser of its own).
ensure_browser() {
  if ! command -v chromium >/dev/null 2>&1; then
    echo "installing missing packages: chromium"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  fi
}

ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "error: no Rust toolchain (cargo) found. Install one with rustup (Rust 1.95 or newer)," >&2
    echo "       then run this command again." >&2
    exit 1
  fi
}
