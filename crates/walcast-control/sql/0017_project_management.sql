-- The management API (README "Running a platform"): a project may be suspended (no new
-- sockets or joins, open ones ended) or private-only (public channels refused), and a
-- rotated secret's predecessor is accepted until `jwt_secret_previous_until` (NULL: with
-- no end, as `walcast project keys --previous-secret` sets it).
ALTER TABLE walcast.projects
    ADD COLUMN IF NOT EXISTS suspended boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS private_only boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS jwt_secret_previous_until timestamptz,
    ADD COLUMN IF NOT EXISTS updated_at timestamptz NOT NULL DEFAULT now();
