-- walcast's own auth.uid() and auth.role() (0002, created only where none existed) parse
-- request.jwt.claims as JSON on every call, so a policy such as `owner = auth.uid()` parsed
-- the claims once per row checked. Like Supabase's own helpers, they now read the single
-- setting walcast puts beside the claims first (request.jwt.claim.sub / .role, set from
-- the same claims in the same transaction; '' when absent) and fall back to the claims,
-- with the same results as before in every case. Replaced only where the function is
-- still walcast's 0002 version: Supabase's or an operator's own is left alone.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_proc
                WHERE oid = to_regprocedure('auth.uid()')
                  AND btrim(prosrc) = $old$SELECT nullif(auth.jwt() ->> 'sub', '')::uuid$old$) THEN
        CREATE OR REPLACE FUNCTION auth.uid() RETURNS uuid LANGUAGE sql STABLE AS
        $f$ SELECT nullif(coalesce(nullif(current_setting('request.jwt.claim.sub', true), ''),
                                   auth.jwt() ->> 'sub'), '')::uuid $f$;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_proc
                WHERE oid = to_regprocedure('auth.role()')
                  AND btrim(prosrc) = $old$SELECT nullif(auth.jwt() ->> 'role', '')$old$) THEN
        CREATE OR REPLACE FUNCTION auth.role() RETURNS text LANGUAGE sql STABLE AS
        $f$ SELECT nullif(coalesce(nullif(current_setting('request.jwt.claim.role', true), ''),
                                   auth.jwt() ->> 'role'), '') $f$;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'walcast: cannot replace the auth helper functions (%)', SQLERRM;
END
$$;
