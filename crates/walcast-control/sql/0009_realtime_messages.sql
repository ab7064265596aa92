-- Broadcast from the database, as Supabase apps expect it: `realtime.messages`,
-- `realtime.topic()`, `realtime.send(...)` and `realtime.broadcast_changes(...)` with
-- Supabase's signatures, created where missing. The cdc-worker reads inserts into
-- realtime.messages from the WAL (only committed ones, in commit order) and delivers them
-- as broadcasts to the topic's subscribers on every front.

CREATE SCHEMA IF NOT EXISTS realtime;

DO $$
BEGIN
    IF to_regclass('realtime.messages') IS NULL THEN
        CREATE TABLE realtime.messages (
            topic       text        NOT NULL,
            extension   text        NOT NULL,
            payload     jsonb,
            event       text,
            private     boolean     DEFAULT false,
            updated_at  timestamp   NOT NULL DEFAULT now(),
            inserted_at timestamp   NOT NULL DEFAULT now(),
            id          uuid        NOT NULL DEFAULT gen_random_uuid(),
            PRIMARY KEY (id, inserted_at)
        ) PARTITION BY RANGE (inserted_at);
        -- Policies on it decide who may read (join) and write (send) private channels.
        ALTER TABLE realtime.messages ENABLE ROW LEVEL SECURITY;
    END IF;
END
$$;

DO $$
BEGIN
    GRANT USAGE ON SCHEMA realtime TO anon, authenticated, service_role;
    GRANT SELECT, INSERT ON realtime.messages TO anon, authenticated, service_role;
EXCEPTION WHEN undefined_object THEN
    RAISE WARNING 'walcast: roles anon, authenticated, service_role missing: realtime.messages granted to none of them';
END
$$;

-- The topic of the statement being judged (set by realtime.send; the policies of
-- private channels compare it).
CREATE OR REPLACE FUNCTION realtime.topic() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('realtime.topic', true), '')::text
$$;

-- Broadcast `payload` as `event` on `topic` once the calling transaction commits. A
-- failure (a policy refusing the insert, say) is reported as a WARNING and does not fail
-- the caller, as with Supabase.
CREATE OR REPLACE FUNCTION realtime.send(payload jsonb, event text, topic text, private boolean DEFAULT true)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    BEGIN
        PERFORM set_config('realtime.topic', topic, true);
        INSERT INTO realtime.messages (payload, event, topic, private, extension)
        VALUES (send.payload, send.event, send.topic, send.private, 'broadcast');
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'ErrorSendingBroadcastMessage: %', SQLERRM;
    END;
END
$$;

-- For row triggers: broadcast the change ({operation, table, schema, record, old_record})
-- on a private channel.
CREATE OR REPLACE FUNCTION realtime.broadcast_changes(
    topic_name text, event_name text, operation text, table_name text, table_schema text,
    new record, old record, level text DEFAULT 'ROW')
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    body jsonb;
BEGIN
    IF level = 'STATEMENT' THEN
        RAISE EXCEPTION 'realtime.broadcast_changes works FOR EACH ROW, not FOR EACH STATEMENT';
    END IF;
    IF operation NOT IN ('INSERT', 'UPDATE', 'DELETE') THEN
        RAISE EXCEPTION 'realtime.broadcast_changes: unexpected operation %', operation;
    END IF;
    body := jsonb_build_object(
        'operation', operation, 'table', table_name, 'schema', table_schema,
        'record', CASE WHEN new IS NULL THEN NULL ELSE to_jsonb(new) END,
        'old_record', CASE WHEN old IS NULL THEN NULL ELSE to_jsonb(old) END);
    PERFORM realtime.send(body, event_name, topic_name, true);
END
$$;

-- realtime.messages partitions for the days around `at` (yesterday to three days ahead),
-- and drop those whose whole day is older than `retention`. Returns the number dropped.
CREATE OR REPLACE FUNCTION walcast.realtime_messages_maintain(
    at timestamptz DEFAULT now(), retention interval DEFAULT interval '3 days')
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today date := (at AT TIME ZONE 'UTC')::date;
    d integer;
    part text;
    p record;
    dropped integer := 0;
BEGIN
    FOR d IN -1..3 LOOP
        part := 'messages_' || to_char(today + d, 'YYYY_MM_DD');
        IF to_regclass(format('realtime.%I', part)) IS NULL THEN
            BEGIN
                EXECUTE format('CREATE TABLE realtime.%I PARTITION OF realtime.messages FOR VALUES FROM (%L) TO (%L)',
                               part, (today + d)::timestamp, (today + d + 1)::timestamp);
            EXCEPTION WHEN invalid_object_definition THEN
                NULL;  -- a partition of another name covers the day already
            END;
        END IF;
    END LOOP;
    FOR p IN
        SELECT c.relname
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'realtime.messages'::regclass
          AND c.relname ~ '^messages_[0-9]{4}_[0-9]{2}_[0-9]{2}$'
          AND to_date(right(c.relname, 10), 'YYYY_MM_DD') + 1 <= ((at - retention) AT TIME ZONE 'UTC')::date
    LOOP
        EXECUTE format('DROP TABLE realtime.%I', p.relname);
        dropped := dropped + 1;
    END LOOP;
    RETURN dropped;
END
$$;

SELECT walcast.realtime_messages_maintain();
