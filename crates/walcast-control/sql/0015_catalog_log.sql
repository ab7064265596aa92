-- Which tables each catalog epoch touched: a worker reading table facts in a
-- snapshot whose epoch is ahead of the WAL position it judges (DDL on other tables keeps
-- moving the epoch, e.g. a burst of enables) may keep the read when no epoch in between
-- touched the tables read. Without this, every read during DDL churn was refused and the
-- changes withheld. Kept for the last 100,000 epochs; an older gap is "unknown" (refused).
CREATE TABLE IF NOT EXISTS walcast.catalog_log (
    epoch  bigint PRIMARY KEY,
    -- The notice's tables (`[{schema, table, dropped}]`), NULL: every table.
    tables jsonb
);
REVOKE ALL ON walcast.catalog_log FROM PUBLIC;

CREATE OR REPLACE FUNCTION walcast.catalog_notice(tag text, tables jsonb)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    e bigint;
    states jsonb;
BEGIN
    UPDATE walcast.catalog_epoch SET n = n + 1 RETURNING n INTO e;
    INSERT INTO walcast.catalog_log (epoch, tables) VALUES (e, tables);
    IF e % 1000 = 0 THEN
        DELETE FROM walcast.catalog_log WHERE epoch <= e - 100000;
    END IF;
    SELECT coalesce(jsonb_agg(walcast.table_state(c.oid, r.schema_name, r.table_name)), '[]')
      INTO states
      FROM walcast.realtime_tables r
      JOIN pg_class c ON c.oid = to_regclass(format('%I.%I', r.schema_name, r.table_name))
     WHERE tables IS NULL
        OR EXISTS (SELECT FROM jsonb_array_elements(tables) t
                    WHERE t->>'schema' = r.schema_name AND t->>'table' = r.table_name
                      AND NOT coalesce((t->>'dropped')::boolean, false));
    PERFORM walcast.emit_signed('walcast.ddl',
        jsonb_build_object('epoch', e, 'tag', tag, 'tables', tables, 'states', states)::text);
END
$$;
REVOKE ALL ON FUNCTION walcast.catalog_notice(text, jsonb) FROM PUBLIC;
