-- Supabase-compatible roles and auth helpers, created only where missing, so existing
-- Supabase policies (auth.uid(), auth.role(), auth.jwt()) work unchanged. walcast checks
-- row-level security as each subscriber: it switches to the subscriber's role (its JWT
-- `role` claim) inside a transaction that is always rolled back, so the connecting role
-- must be a member of those roles.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['anon', 'authenticated', 'service_role'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            IF r = 'service_role' THEN
                EXECUTE format('CREATE ROLE %I NOLOGIN NOINHERIT BYPASSRLS', r);
            ELSE
                EXECUTE format('CREATE ROLE %I NOLOGIN NOINHERIT', r);
            END IF;
        END IF;
        IF NOT pg_has_role(current_user, r, 'MEMBER') THEN
            EXECUTE format('GRANT %I TO %I', r, current_user);
        END IF;
    END LOOP;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'walcast: cannot create or grant the roles anon, authenticated, service_role (%): create them and GRANT them TO % so realtime can check row-level security as each subscriber', SQLERRM, current_user;
END
$$;

CREATE SCHEMA IF NOT EXISTS auth;

DO $$
BEGIN
    IF to_regprocedure('auth.jwt()') IS NULL THEN
        CREATE FUNCTION auth.jwt() RETURNS jsonb LANGUAGE sql STABLE AS
        $f$ SELECT coalesce(nullif(current_setting('request.jwt.claims', true), ''), '{}')::jsonb $f$;
    END IF;
    IF to_regprocedure('auth.uid()') IS NULL THEN
        CREATE FUNCTION auth.uid() RETURNS uuid LANGUAGE sql STABLE AS
        $f$ SELECT nullif(auth.jwt() ->> 'sub', '')::uuid $f$;
    END IF;
    IF to_regprocedure('auth.role()') IS NULL THEN
        CREATE FUNCTION auth.role() RETURNS text LANGUAGE sql STABLE AS
        $f$ SELECT nullif(auth.jwt() ->> 'role', '') $f$;
    END IF;
    GRANT USAGE ON SCHEMA auth TO anon, authenticated, service_role;
EXCEPTION WHEN insufficient_privilege OR undefined_object THEN
    RAISE WARNING 'walcast: cannot create the auth helper functions (%)', SQLERRM;
END
$$;
