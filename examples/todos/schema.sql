-- The example app's tables and policies. Run by its server at start (idempotent) with the
-- database login of ./dev/up; the roles `authenticated` and the schema `realtime` exist once
-- walcast has run its migrations.

-- Each user's todos: a user reads and writes only its own rows, and so does walcast when it
-- streams them (the same SELECT policy decides who receives a change).
CREATE TABLE IF NOT EXISTS public.example_todos (
    id bigserial PRIMARY KEY,
    owner uuid NOT NULL DEFAULT auth.uid(),
    title text NOT NULL CHECK (char_length(title) BETWEEN 1 AND 200),
    done boolean NOT NULL DEFAULT false,
    inserted_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE public.example_todos ENABLE ROW LEVEL SECURITY;
GRANT SELECT, INSERT, UPDATE, DELETE ON public.example_todos TO authenticated;
GRANT USAGE ON SEQUENCE public.example_todos_id_seq TO authenticated;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_policies
                    WHERE schemaname = 'public' AND tablename = 'example_todos'
                      AND policyname = 'example_todos_own') THEN
        CREATE POLICY example_todos_own ON public.example_todos TO authenticated
            USING (owner = auth.uid()) WITH CHECK (owner = auth.uid());
    END IF;
    -- The lobby is a private channel: signed-in users may join it (SELECT), and track
    -- their presence and send broadcasts in it (INSERT); anonymous keys may not.
    IF NOT EXISTS (SELECT FROM pg_policies
                    WHERE schemaname = 'realtime' AND tablename = 'messages'
                      AND policyname = 'example_lobby_read') THEN
        CREATE POLICY example_lobby_read ON realtime.messages FOR SELECT TO authenticated
            USING (realtime.topic() = 'room:lobby');
    END IF;
    IF NOT EXISTS (SELECT FROM pg_policies
                    WHERE schemaname = 'realtime' AND tablename = 'messages'
                      AND policyname = 'example_lobby_write') THEN
        CREATE POLICY example_lobby_write ON realtime.messages FOR INSERT TO authenticated
            WITH CHECK (realtime.topic() = 'room:lobby');
    END IF;
END
$$;
