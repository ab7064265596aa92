-- Leader election in Postgres mode (LEASE_MODE=postgres): one row per lease name,
-- renewed by its holder, judged by the database's own clock. Every write is a single
-- statement, compare-and-set on `term`, so no lock is held across a round trip.
CREATE TABLE IF NOT EXISTS walcast.leases (
    name           text        PRIMARY KEY,
    -- Who holds it, for people (pod name or generated); NULL: free (released).
    holder         text,
    -- The application_name of the holder's sessions: a worker taking over an expired
    -- lease terminates them (its walsender keeps the slot active while it lives).
    holder_session text,
    -- The fencing number: one more on every acquisition, never reused.
    term           bigint      NOT NULL DEFAULT 0,
    -- Written with clock_timestamp() by the holder on every renewal.
    renewed_at     timestamptz,
    -- The holder's lease duration: expired once clock_timestamp() >= renewed_at + it.
    duration_ms    bigint      NOT NULL CHECK (duration_ms > 0),
    acquired_at    timestamptz
);
