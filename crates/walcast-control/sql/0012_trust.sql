-- What walcast trusts in the database (docs/security.md):
--   * walcast.project_roles: which database roles may act for which project when they
--     write what walcast relays (walcast.emit events, realtime.messages rows). A role may
--     act for a project when it is a superuser, a member of the role that owns the
--     `walcast` schema (walcast's own), or a member of a role mapped to the project here
--     (`PUBLIC` = every role). Only the default project is mapped to PUBLIC out of the
--     box, so a single-project database keeps working; a platform hosting several
--     projects deletes that row and maps each project's own roles.
--   * walcast.message_key: a random key only walcast's role can read. Every logical
--     message walcast relies on (catalog notices, outbox events) is written through
--     walcast.emit_signed, which prefixes its content with a MAC under that key; the
--     pipeline honours a `walcast.*` message only when its MAC verifies. Any role can
--     call pg_logical_emit_message, but no role other than walcast's can sign.

CREATE TABLE IF NOT EXISTS walcast.project_roles (
    project text NOT NULL,
    -- A role name, or 'PUBLIC' for every role.
    role    name NOT NULL,
    PRIMARY KEY (project, role)
);
REVOKE ALL ON walcast.project_roles FROM PUBLIC;
INSERT INTO walcast.project_roles (project, role) VALUES ('default', 'PUBLIC')
    ON CONFLICT DO NOTHING;

-- May role `who` act for `project`?
CREATE OR REPLACE FUNCTION walcast.may_act_for(project text, who name)
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT FROM pg_roles r WHERE r.rolname = who AND r.rolsuper)
        OR EXISTS (SELECT FROM pg_namespace n
                    WHERE n.nspname = 'walcast'
                      AND EXISTS (SELECT FROM pg_roles r WHERE r.rolname = who)
                      AND pg_has_role(who, n.nspowner, 'MEMBER'))
        OR EXISTS (SELECT FROM walcast.project_roles m
                    WHERE m.project = may_act_for.project
                      AND (m.role = 'PUBLIC'
                           OR (EXISTS (SELECT FROM pg_roles r WHERE r.rolname = m.role)
                               AND EXISTS (SELECT FROM pg_roles r WHERE r.rolname = who)
                               AND pg_has_role(who, m.role, 'MEMBER'))))
$$;
REVOKE ALL ON FUNCTION walcast.may_act_for(text, name) FROM PUBLIC;

-- The project the calling session writes for: the `walcast.project` setting (default
-- `default`), refused unless the session's login role may act for it. `session_user`,
-- not `current_user`: inside a SECURITY DEFINER function the current user is the
-- function's owner, and a SET ROLE does not change what the login may do.
CREATE OR REPLACE FUNCTION walcast.caller_project()
RETURNS text LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p text := coalesce(nullif(current_setting('walcast.project', true), ''), 'default');
BEGIN
    IF NOT walcast.may_act_for(p, session_user) THEN
        RAISE EXCEPTION 'walcast: role % may not act for project % (see walcast.project_roles)',
            quote_ident(session_user), quote_literal(p)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN p;
END
$$;
GRANT EXECUTE ON FUNCTION walcast.caller_project() TO PUBLIC;

CREATE TABLE IF NOT EXISTS walcast.message_key (
    only_one boolean PRIMARY KEY DEFAULT true CHECK (only_one),
    -- 64 hex digits from gen_random_uuid (a strong random source).
    key      text    NOT NULL
);
REVOKE ALL ON walcast.message_key FROM PUBLIC;
INSERT INTO walcast.message_key (key)
    VALUES (replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''))
    ON CONFLICT DO NOTHING;

-- The MAC of a message: hex(sha256(key ':' prefix ':' sha256(content))). The inner hash
-- has a fixed length, so no other (prefix, content) extends a known MAC.
CREATE OR REPLACE FUNCTION walcast.message_mac(key text, prefix text, content text)
RETURNS text LANGUAGE sql IMMUTABLE STRICT
SET search_path = pg_catalog, pg_temp AS $$
    SELECT encode(sha256(convert_to(key || ':' || prefix || ':', 'UTF8')
                         || sha256(convert_to(content, 'UTF8'))), 'hex')
$$;

-- Write a transactional logical message walcast will trust: its content is the MAC (64
-- hex digits) followed by `content`. Callable only by walcast's own SECURITY DEFINER
-- functions (and its role).
CREATE OR REPLACE FUNCTION walcast.emit_signed(prefix text, content text)
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    k text;
BEGIN
    SELECT m.key INTO STRICT k FROM walcast.message_key m;
    PERFORM pg_logical_emit_message(true, prefix, walcast.message_mac(k, prefix, content) || content);
END
$$;
REVOKE ALL ON FUNCTION walcast.emit_signed(text, text) FROM PUBLIC;
