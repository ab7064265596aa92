-- Only walcast writes what walcast trusts (docs/security.md, "What the database may tell
-- walcast"):
--   * catalog notices (`walcast.ddl`) and outbox events (`walcast.outbox`) are written
--     through walcast.emit_signed (0012): the pipeline honours a `walcast.*` logical
--     message only when its MAC verifies, so a role calling pg_logical_emit_message
--     itself forges nothing (the message is skipped and counted);
--   * walcast.emit runs as walcast (SECURITY DEFINER, search_path pinned) and takes its
--     project from walcast.caller_project(): a role emits only into the projects
--     walcast.project_roles maps it to;
--   * functions are executable by PUBLIC unless revoked: every internal function is
--     revoked here; applications keep walcast.emit and walcast.caller_project.

-- Where signing starts: messages of transactions that committed before this point were
-- written unsigned by the functions replaced below, and a worker replaying them after an
-- upgrade (say, outbox events emitted while no worker ran) still takes them; nothing
-- committed after it is taken unsigned.
CREATE TABLE IF NOT EXISTS walcast.message_signing (
    only_one boolean PRIMARY KEY DEFAULT true CHECK (only_one),
    since    pg_lsn  NOT NULL
);
REVOKE ALL ON walcast.message_signing FROM PUBLIC;
INSERT INTO walcast.message_signing (since) VALUES (pg_current_wal_lsn())
    ON CONFLICT DO NOTHING;

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
    PERFORM walcast.emit_signed('walcast.ddl',
        jsonb_build_object('epoch', e, 'tag', tag, 'tables', tables, 'states', states)::text);
END
$$;

-- Emit an event in the caller's transaction, for the project the caller may act for
-- (walcast.caller_project: the `walcast.project` setting, refused unless the session's
-- login role is mapped to it). Returns the event's id (the JetStream `Nats-Msg-Id`).
CREATE OR REPLACE FUNCTION walcast.emit(topic text, key text, payload jsonb, headers jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    event_id uuid := gen_random_uuid();
    project text := walcast.caller_project();
BEGIN
    IF topic IS NULL OR topic !~ '^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$' THEN
        RAISE EXCEPTION 'walcast.emit: topic % is not dot-separated tokens of letters, digits, _ or -', quote_nullable(topic)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'walcast.emit: payload is required' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF headers IS NOT NULL AND jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'walcast.emit: headers must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM walcast.emit_signed('walcast.outbox', jsonb_build_object(
        'id', event_id, 'project', project, 'topic', topic, 'key', key,
        'payload', payload, 'headers', headers)::text);
    RETURN event_id;
END
$$;
GRANT EXECUTE ON FUNCTION walcast.emit(text, text, jsonb, jsonb) TO PUBLIC;

-- Internal functions: walcast's role (the owner), superusers and walcast's own SECURITY
-- DEFINER functions call them; nobody else. (Trigger and event-trigger functions are not
-- checked when they fire, only when a trigger is created.) Left executable:
-- walcast.sync_supabase_realtime, which the publication event trigger's function calls
-- as the role running ALTER PUBLICATION, and which runs with that role's privileges.
REVOKE ALL ON FUNCTION walcast.table_state(oid, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.catalog_notice(text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.on_ddl_command_end() FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.on_sql_drop() FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.outbox_insert_only() FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.outbox_partition(walcast.outbox_tables, date) FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.outbox_create(text, name, name, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.outbox_maintain(timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.realtime_messages_maintain(timestamptz, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.on_publication_change() FROM PUBLIC;
REVOKE ALL ON FUNCTION walcast.message_mac(text, text, text) FROM PUBLIC;
