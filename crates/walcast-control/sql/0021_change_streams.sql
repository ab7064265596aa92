-- Change streams (README "Change streams"): the tables whose changes the leader also
-- stores in the JetStream stream WALCAST_CHANGES (subjects
-- walcast.changes.<project>.<schema>.<table>), acknowledging the slot past a change only
-- once JetStream acknowledged it. A table streams for one project, the one of its
-- realtime-tables row when it has one (`walcast changes enable` checks; the unique key
-- keeps one project per table). Decoded by the pipeline (REPLICA IDENTITY FULL), so an
-- edit takes effect exactly at its WAL position. Only walcast's own role may change it:
-- a tenant able to add a row could stream another project's table into its subjects.
CREATE TABLE IF NOT EXISTS walcast.change_stream_tables (
    project_id  text        NOT NULL DEFAULT 'default',
    schema_name text        NOT NULL,
    table_name  text        NOT NULL,
    enabled_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (schema_name, table_name)
);
ALTER TABLE walcast.change_stream_tables REPLICA IDENTITY FULL;
REVOKE ALL ON walcast.change_stream_tables FROM PUBLIC;
