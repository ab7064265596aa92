-- Snapshots (README "Change streams", docs/design-snapshots.md): `walcast snapshot start`
-- queues a table's current rows to be published on its change stream as READ events,
-- read by the source's leader in primary-key chunks between signed watermarks
-- (`walcast.snapshot` logical messages). `last_key` (the primary key of the last row
-- whose chunk JetStream acknowledged, a JSON array) is where a new leader resumes after
-- a crash. `filter` is a `postgres_changes` filter string (parsed, values bound: never
-- SQL). Only walcast's own role reads or writes it: a row names what the leader reads
-- and publishes.
CREATE TABLE IF NOT EXISTS walcast.snapshots (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project_id    text        NOT NULL DEFAULT 'default',
    schema_name   text        NOT NULL,
    table_name    text        NOT NULL,
    filter        text        NOT NULL DEFAULT '',
    state         text        NOT NULL DEFAULT 'queued'
                  CHECK (state IN ('queued', 'running', 'done', 'cancelled', 'failed')),
    last_key      jsonb,
    rows_done     bigint      NOT NULL DEFAULT 0,
    chunks_done   bigint      NOT NULL DEFAULT 0,
    rows_estimate bigint      NOT NULL DEFAULT 0,
    error         text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    started_at    timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz
);
CREATE INDEX IF NOT EXISTS snapshots_active ON walcast.snapshots (id)
    WHERE state IN ('queued', 'running');
REVOKE ALL ON walcast.snapshots FROM PUBLIC;
