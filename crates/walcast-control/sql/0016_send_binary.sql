-- Binary broadcasts from the database, as Supabase has them: a `binary_payload` column of
-- realtime.messages and `realtime.send_binary(payload bytea, event, topic, private)`.
-- The cdc-worker delivers such a row's bytes as they are (kind 4 with the binary payload
-- encoding under vsn 2.0.0; sockets of vsn 1.0.0 cannot carry them and get nothing), and a
-- replay returns them among the JSON messages, in order.
--
-- Same trust model as realtime.send (0009, 0014): send_binary runs as its caller
-- (SECURITY INVOKER), so the caller needs INSERT on realtime.messages and the app's
-- policies judge the row (a private topic's INSERT policy sees realtime.topic()); the
-- trigger of 0014 gives the row the caller's project and refuses another. Nothing here is
-- signed or trusted beyond what a row of realtime.messages already is.

ALTER TABLE realtime.messages ADD COLUMN IF NOT EXISTS binary_payload bytea;

-- A row is a JSON message or a binary one, never both. NOT VALID: no row has bytes yet,
-- and rows written before are not scanned.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                    WHERE conrelid = 'realtime.messages'::regclass
                      AND conname = 'messages_payload_exclusive') THEN
        ALTER TABLE realtime.messages
            ADD CONSTRAINT messages_payload_exclusive
            CHECK (payload IS NULL OR binary_payload IS NULL) NOT VALID;
    END IF;
END
$$;

-- Broadcast the bytes `payload` as `event` on `topic` once the calling transaction
-- commits. A failure (a policy refusing the insert, a NULL payload) is a WARNING and does
-- not fail the caller, as with realtime.send. Created where missing: a database that has
-- Supabase's own (same signature, same behaviour) keeps it.
DO $$
BEGIN
    IF to_regprocedure('realtime.send_binary(bytea, text, text, boolean)') IS NOT NULL THEN
        RETURN;
    END IF;
    CREATE FUNCTION realtime.send_binary(payload bytea, event text, topic text, private boolean DEFAULT true)
    RETURNS void
    LANGUAGE plpgsql VOLATILE AS $fn$
    BEGIN
        BEGIN
            IF payload IS NULL THEN
                RAISE EXCEPTION 'the payload of realtime.send_binary is NULL';
            END IF;
            PERFORM set_config('realtime.topic', topic, true);
            INSERT INTO realtime.messages (binary_payload, event, topic, private, extension)
            VALUES (send_binary.payload, send_binary.event, send_binary.topic, send_binary.private, 'broadcast');
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'ErrorSendingBroadcastMessage: %', SQLERRM;
        END;
    END
    $fn$;
END
$$;
