-- walcast's own objects live in schema "walcast".
-- The realtime registry: tables whose changes are streamed, per project.
CREATE TABLE IF NOT EXISTS walcast.realtime_tables (
    project_id  text        NOT NULL DEFAULT 'default',
    schema_name text        NOT NULL,
    table_name  text        NOT NULL,
    enabled_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (project_id, schema_name, table_name)
);
-- The poller decodes this table too, so enabling or disabling a table reaches the
-- pipeline in WAL order, exactly between the changes before and after it.
ALTER TABLE walcast.realtime_tables REPLICA IDENTITY FULL;
