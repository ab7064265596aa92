-- Privileges and schema changes at their WAL position (see the README's guarantees).
-- wal2json decodes no DDL and no GRANT: event triggers put a transactional logical
-- message (prefix `walcast.ddl`) into the WAL of every statement that can change what a
-- subscriber may read of a table, so it lands exactly at that statement's commit
-- position and the pipeline applies it between the changes before and after it.
-- Creating an event trigger needs a superuser: the worker creates the two triggers at
-- start when its role may (see crates/walcast-cdc/src/catalog_change.rs), and otherwise
-- runs without them (every batch re-reads the catalog) and says so in /health.

-- One row: incremented by every such statement, in the same transaction, so a snapshot
-- that reads it knows how many of them it sees. The pipeline compares it with the last
-- notice it decoded: a snapshot that sees more describes a later state than the
-- position being judged.
CREATE TABLE IF NOT EXISTS walcast.catalog_epoch (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    n  bigint  NOT NULL
);
INSERT INTO walcast.catalog_epoch (id, n) VALUES (true, 0) ON CONFLICT DO NOTHING;

-- The epoch at a commit position of a slot, written by the worker when it decodes a
-- notice (before it acknowledges that position), so that a restarted worker knows the
-- epoch at the position it resumes from.
CREATE TABLE IF NOT EXISTS walcast.catalog_positions (
    slot_name  text   NOT NULL,
    commit_lsn pg_lsn NOT NULL,
    epoch      bigint NOT NULL,
    PRIMARY KEY (slot_name, commit_lsn)
);

-- Bump the epoch and write the notice: {"epoch", "tag", "tables"}, `tables` null when
-- the statement does not say which tables it touched (GRANT, REVOKE, policies …).
CREATE OR REPLACE FUNCTION walcast.catalog_notice(tag text, tables jsonb)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    e bigint;
BEGIN
    UPDATE walcast.catalog_epoch SET n = n + 1 RETURNING n INTO e;
    PERFORM pg_logical_emit_message(true, 'walcast.ddl',
        jsonb_build_object('epoch', e, 'tag', tag, 'tables', tables)::text);
END
$$;

-- ddl_command_end: ALTER TABLE names its tables; the others apply to tables the
-- function cannot list (GRANT and REVOKE do not expose their objects to event triggers).
CREATE OR REPLACE FUNCTION walcast.on_ddl_command_end()
RETURNS event_trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    tables jsonb;
BEGIN
    IF tg_tag = 'ALTER TABLE' THEN
        SELECT jsonb_agg(DISTINCT jsonb_build_object('schema', n.nspname, 'table', c.relname))
          INTO tables
          FROM pg_event_trigger_ddl_commands() d
          JOIN pg_class c ON d.classid = 'pg_class'::regclass AND c.oid = d.objid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'p');
        IF tables IS NULL THEN
            RETURN;
        END IF;
    END IF;
    PERFORM walcast.catalog_notice(tg_tag, tables);
END
$$;

-- sql_drop: dropped tables leave the realtime registry in the same transaction (the
-- registry edit is decoded right after the notice, at the same position).
CREATE OR REPLACE FUNCTION walcast.on_sql_drop()
RETURNS event_trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    tables jsonb;
BEGIN
    SELECT jsonb_agg(jsonb_build_object('schema', d.schema_name, 'table', d.object_name,
                                        'dropped', true))
      INTO tables
      FROM pg_event_trigger_dropped_objects() d
     WHERE d.object_type = 'table' AND NOT d.is_temporary;
    IF tables IS NULL THEN
        RETURN;
    END IF;
    PERFORM walcast.catalog_notice(tg_tag, tables);
    DELETE FROM walcast.realtime_tables r
     USING pg_event_trigger_dropped_objects() d
     WHERE d.object_type = 'table' AND NOT d.is_temporary
       AND r.schema_name = d.schema_name AND r.table_name = d.object_name;
END
$$;
