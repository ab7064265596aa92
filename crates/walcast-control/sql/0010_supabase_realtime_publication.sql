-- The `supabase_realtime` publication as the switch for the default project, as Supabase
-- apps and their migrations use it: a table added to it is enabled, a table removed
-- from it (or the publication dropped) is disabled. The registry edits happen in the
-- same transaction as the ALTER PUBLICATION, so the pipeline applies them at that WAL
-- position, like any registry edit. `walcast realtime enable/disable` (and the REST API)
-- update the publication too when it exists, so both ways agree.

ALTER TABLE walcast.realtime_tables
    ADD COLUMN IF NOT EXISTS via_publication boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION walcast.sync_supabase_realtime() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT p.schemaname, p.tablename
        FROM pg_publication_tables p
        WHERE p.pubname = 'supabase_realtime'
          AND NOT EXISTS (SELECT 1 FROM walcast.realtime_tables r
                          WHERE r.schema_name = p.schemaname AND r.table_name = p.tablename)
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_index i
                       WHERE i.indrelid = format('%I.%I', t.schemaname, t.tablename)::regclass
                         AND i.indisprimary) THEN
            RAISE WARNING 'walcast: %.% is in supabase_realtime but has no primary key: not streamed',
                t.schemaname, t.tablename;
            CONTINUE;
        END IF;
        EXECUTE format('ALTER TABLE %I.%I REPLICA IDENTITY FULL', t.schemaname, t.tablename);
        INSERT INTO walcast.realtime_tables (project_id, schema_name, table_name, via_publication)
        VALUES ('default', t.schemaname, t.tablename, true)
        ON CONFLICT DO NOTHING;
    END LOOP;
    DELETE FROM walcast.realtime_tables r
    WHERE r.via_publication
      AND NOT EXISTS (SELECT 1 FROM pg_publication_tables p
                      WHERE p.pubname = 'supabase_realtime'
                        AND p.schemaname = r.schema_name AND p.tablename = r.table_name);
END
$$;

CREATE OR REPLACE FUNCTION walcast.on_publication_change() RETURNS event_trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM walcast.sync_supabase_realtime();
END
$$;

DO $$
BEGIN
    DROP EVENT TRIGGER IF EXISTS walcast_supabase_realtime;
    CREATE EVENT TRIGGER walcast_supabase_realtime ON ddl_command_end
        WHEN TAG IN ('CREATE PUBLICATION', 'ALTER PUBLICATION', 'DROP PUBLICATION')
        EXECUTE FUNCTION walcast.on_publication_change();
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'walcast: cannot create the event trigger that follows the supabase_realtime publication (needs a superuser): enable tables with walcast realtime enable';
END
$$;

SELECT walcast.sync_supabase_realtime();
