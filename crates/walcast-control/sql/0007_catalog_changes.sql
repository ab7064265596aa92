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

-- The epoch at a commit position of a slot, and the table states the notices decoded so
-- far carry (the latest per table), written by the worker when it decodes a notice
-- (before it acknowledges that position), so that a restarted worker resumes with both.
CREATE TABLE IF NOT EXISTS walcast.catalog_positions (
    slot_name  text   NOT NULL,
    commit_lsn pg_lsn NOT NULL,
    epoch      bigint NOT NULL,
    carried    jsonb  NOT NULL DEFAULT '[]',
    PRIMARY KEY (slot_name, commit_lsn)
);

-- What a subscriber's role may read of a streamed table, as of now: RLS switch, key,
-- columns, and per role (those that may read some column) which columns it may SELECT.
-- Carried in the notice, so the pipeline knows the state at the notice's position even
-- when the catalog has moved on since (a later statement already committed).
CREATE OR REPLACE FUNCTION walcast.table_state(rel oid, schema_name text, table_name text)
RETURNS jsonb LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp AS $$
SELECT jsonb_build_object(
    'schema', schema_name,
    'table', table_name,
    'rls', c.relrowsecurity,
    'pk', coalesce((
        SELECT jsonb_agg(jsonb_build_array(a.attname, format_type(a.atttypid, a.atttypmod))
                         ORDER BY k.n)
          FROM pg_index i
          JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, n) ON true
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
         WHERE i.indrelid = c.oid AND i.indisprimary), '[]'),
    'columns', coalesce((
        SELECT jsonb_agg(jsonb_build_array(a.attname, format_type(a.atttypid, a.atttypmod),
                         a.atttypid IN ('numeric'::regtype, 'real'::regtype,
                                        'double precision'::regtype)) ORDER BY a.attnum)
          FROM pg_attribute a
         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '[]'),
    'roles', coalesce((
        SELECT jsonb_object_agg(r.rolname,
                   jsonb_build_object('bypass', r.rolbypassrls, 'columns', x.cols))
          FROM pg_roles r,
               LATERAL (SELECT jsonb_agg(a.attname ORDER BY a.attnum) AS cols
                          FROM pg_attribute a
                         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                           AND has_column_privilege(r.oid, c.oid, a.attnum, 'SELECT')) x
         WHERE x.cols IS NOT NULL AND r.rolname !~ '^pg_'), '{}'))
  FROM pg_class c
 WHERE c.oid = rel
$$;

-- Bump the epoch and write the notice: {"epoch", "tag", "tables", "states"}, `tables`
-- null when the statement does not say which tables it touched (GRANT, REVOKE,
-- policies …); `states`: the state of the streamed tables it may have changed, read
-- after taking the epoch row's lock (every later such statement waits for our commit,
-- every earlier one has committed: the state is the one at our commit position).
CREATE OR REPLACE FUNCTION walcast.catalog_notice(tag text, tables jsonb)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    e bigint;
    states jsonb;
BEGIN
    UPDATE walcast.catalog_epoch SET n = n + 1 RETURNING n INTO e;
    SELECT coalesce(jsonb_agg(walcast.table_state(c.oid, r.schema_name, r.table_name)), '[]')
      INTO states
      FROM walcast.realtime_tables r
      JOIN pg_class c ON c.oid = to_regclass(format('%I.%I', r.schema_name, r.table_name))
     WHERE tables IS NULL
        OR EXISTS (SELECT FROM jsonb_array_elements(tables) t
                    WHERE t->>'schema' = r.schema_name AND t->>'table' = r.table_name
                      AND NOT coalesce((t->>'dropped')::boolean, false));
    PERFORM pg_logical_emit_message(true, 'walcast.ddl',
        jsonb_build_object('epoch', e, 'tag', tag, 'tables', tables, 'states', states)::text);
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
