-- The transactional outbox (docs/outbox.md). Two ways to emit an event, both relayed
-- from the WAL by the leading cdc-worker to NATS JetStream, in commit order:
--   * walcast.emit(topic, key, payload, headers): a transactional logical message, no
--     table written at all;
--   * an outbox table (walcast.outbox_create): insert-only, range-partitioned by day,
--     old partitions dropped (never DELETE), so it never needs VACUUM for dead tuples.

-- Applications call walcast.emit; nothing else in this schema is granted to them.
GRANT USAGE ON SCHEMA walcast TO PUBLIC;

-- Emit an event in the caller's transaction: it is relayed only if that transaction
-- commits. The project is the `walcast.project` setting (default `default`). Returns the
-- event's id (the JetStream `Nats-Msg-Id`).
CREATE OR REPLACE FUNCTION walcast.emit(topic text, key text, payload jsonb, headers jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog
AS $$
DECLARE
    event_id uuid := gen_random_uuid();
    project text := coalesce(nullif(current_setting('walcast.project', true), ''), 'default');
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
    PERFORM pg_logical_emit_message(true, 'walcast.outbox', jsonb_build_object(
        'id', event_id, 'project', project, 'topic', topic, 'key', key,
        'payload', payload, 'headers', headers)::text);
    RETURN event_id;
END
$$;
GRANT EXECUTE ON FUNCTION walcast.emit(text, text, jsonb, jsonb) TO PUBLIC;

-- Outbox tables. Their partitions live in one schema of their own, so that the decoder's
-- table filter names them all with one entry (`walcast_outbox_parts.*`), partitions
-- created later included. A partition is named o<id>_<yyyymmdd> (id: its outbox table's).
CREATE SCHEMA IF NOT EXISTS walcast_outbox_parts;

CREATE TABLE IF NOT EXISTS walcast.outbox_tables (
    id          serial      PRIMARY KEY,
    project     text        NOT NULL,
    schema_name name        NOT NULL,
    table_name  name        NOT NULL,
    -- Partitions whose whole day is older than this are dropped.
    retention   interval    NOT NULL DEFAULT interval '7 days',
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (schema_name, table_name)
);
REVOKE ALL ON walcast.outbox_tables FROM PUBLIC;

-- Outbox rows are never updated or deleted (old days are dropped whole).
CREATE OR REPLACE FUNCTION walcast.outbox_insert_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'walcast outbox %.% is insert-only (old partitions are dropped by retention)',
        TG_TABLE_SCHEMA, TG_TABLE_NAME USING ERRCODE = 'feature_not_supported';
END
$$;

-- The partition of outbox `t` for the UTC day of `day`, created if missing.
CREATE OR REPLACE FUNCTION walcast.outbox_partition(t walcast.outbox_tables, day date)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    part text := format('o%s_%s', t.id, to_char(day, 'YYYYMMDD'));
BEGIN
    IF to_regclass(format('walcast_outbox_parts.%I', part)) IS NOT NULL THEN
        RETURN;
    END IF;
    EXECUTE format(
        'CREATE TABLE walcast_outbox_parts.%I PARTITION OF %I.%I FOR VALUES FROM (%L) TO (%L)',
        part, t.schema_name, t.table_name,
        (day::timestamp AT TIME ZONE 'UTC'), ((day + 1)::timestamp AT TIME ZONE 'UTC'));
END
$$;

-- Create an outbox table `schema_name.table_name` for `project`, with partitions for
-- today and the next days; returns its id. Idempotent.
CREATE OR REPLACE FUNCTION walcast.outbox_create(project text, schema_name name, table_name name,
                                                 retention interval DEFAULT interval '7 days')
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    t walcast.outbox_tables;
BEGIN
    IF retention < interval '1 day' THEN
        RAISE EXCEPTION 'outbox retention must be at least one day (got %)', retention
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format($ddl$
        CREATE TABLE IF NOT EXISTS %I.%I (
            id             uuid        NOT NULL DEFAULT gen_random_uuid(),
            aggregate_type text        NOT NULL,
            aggregate_id   text        NOT NULL,
            event_type     text        NOT NULL,
            schema_version integer     NOT NULL DEFAULT 1,
            payload        jsonb       NOT NULL,
            headers        jsonb,
            occurred_at    timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (id, occurred_at),
            CHECK (aggregate_type ~ '^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$'),
            CHECK (headers IS NULL OR jsonb_typeof(headers) = 'object')
        ) PARTITION BY RANGE (occurred_at)$ddl$, schema_name, table_name);
    EXECUTE format('DROP TRIGGER IF EXISTS walcast_outbox_insert_only ON %I.%I', schema_name, table_name);
    EXECUTE format('CREATE TRIGGER walcast_outbox_insert_only BEFORE UPDATE OR DELETE ON %I.%I
                    FOR EACH ROW EXECUTE FUNCTION walcast.outbox_insert_only()', schema_name, table_name);
    INSERT INTO walcast.outbox_tables AS o (project, schema_name, table_name, retention)
    VALUES (outbox_create.project, outbox_create.schema_name, outbox_create.table_name,
            outbox_create.retention)
    ON CONFLICT ON CONSTRAINT outbox_tables_schema_name_table_name_key
        DO UPDATE SET retention = excluded.retention
    RETURNING * INTO t;
    IF t.project <> outbox_create.project THEN
        RAISE EXCEPTION 'outbox %.% belongs to project %', schema_name, table_name, t.project
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM walcast.outbox_maintain(now());
    RETURN t.id;
END
$$;

-- Partitions for the days around `at` (yesterday to three days ahead) for every outbox,
-- and drop those whose whole day is older than the outbox's retention. Returns the
-- number of partitions dropped. The leading cdc-worker calls it periodically.
CREATE OR REPLACE FUNCTION walcast.outbox_maintain(at timestamptz DEFAULT now())
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    t walcast.outbox_tables;
    today date := (at AT TIME ZONE 'UTC')::date;
    d integer;
    p record;
    dropped integer := 0;
BEGIN
    FOR t IN SELECT * FROM walcast.outbox_tables ORDER BY id LOOP
        IF to_regclass(format('%I.%I', t.schema_name, t.table_name)) IS NULL THEN
            CONTINUE;
        END IF;
        FOR d IN -1..3 LOOP
            PERFORM walcast.outbox_partition(t, today + d);
        END LOOP;
        FOR p IN
            SELECT c.relname
            FROM pg_inherits i
            JOIN pg_class c ON c.oid = i.inhrelid
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE i.inhparent = format('%I.%I', t.schema_name, t.table_name)::regclass
              AND n.nspname = 'walcast_outbox_parts'
              AND c.relname ~ ('^o' || t.id || '_[0-9]{8}$')
              AND to_date(right(c.relname, 8), 'YYYYMMDD') + 1 <= ((at - t.retention) AT TIME ZONE 'UTC')::date
        LOOP
            EXECUTE format('DROP TABLE walcast_outbox_parts.%I', p.relname);
            dropped := dropped + 1;
        END LOOP;
    END LOOP;
    RETURN dropped;
END
$$;

-- Events JetStream refused for good (too large, no stream for the subject): kept with
-- the error until `walcast outbox redrive` sends them again.
CREATE TABLE IF NOT EXISTS walcast.outbox_quarantine (
    id             uuid        PRIMARY KEY,
    project        text        NOT NULL,
    topic          text        NOT NULL,
    key            text,
    subject        text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    commit_lsn     pg_lsn      NOT NULL,
    error          text        NOT NULL,
    quarantined_at timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON walcast.outbox_quarantine FROM PUBLIC;
