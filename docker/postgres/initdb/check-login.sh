#!/bin/sh
# The check login (README "The check login"): created once, on an empty data directory,
# by the official image's entrypoint. Its password comes from WALCAST_CHECK_PASSWORD.
set -eu
psql -v ON_ERROR_STOP=1 -v pw="${WALCAST_CHECK_PASSWORD:?set WALCAST_CHECK_PASSWORD}" \
  --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<'SQL'
CREATE ROLE walcast_check LOGIN NOINHERIT PASSWORD :'pw';
SQL
