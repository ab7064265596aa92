-- A table streams for one project: its changes are routed to exactly one project's
-- subscribers. (`walcast realtime enable` and the REST API also check this first, to
-- give a clear error; the index makes it hold under concurrent enables too.)
CREATE UNIQUE INDEX IF NOT EXISTS realtime_tables_one_project
    ON walcast.realtime_tables (schema_name, table_name);
