-- The check login (README "The check login", docs/security.md): the session user of every
-- connection on which walcast runs SQL a tenant wrote (row-level security policies, the
-- policies of private channels, SSE snapshots), with no privileges of its own, so that
-- `RESET ROLE` or `SET ROLE NONE` from inside a policy regains nothing. walcast records
-- it here at start (CHECK_DATABASE_URL's login) after checking it.
CREATE TABLE IF NOT EXISTS walcast.check_logins (
    role       name        PRIMARY KEY,
    checked_at timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON walcast.check_logins FROM PUBLIC;

CREATE OR REPLACE FUNCTION walcast.is_check_login(who name)
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT FROM walcast.check_logins c WHERE c.role = who)
$$;
REVOKE ALL ON FUNCTION walcast.is_check_login(name) FROM PUBLIC;

-- A private-channel check runs as the check login: its write check inserts a message as
-- the subscriber, its read check a probe message (walcast.probe_message) that the
-- subscriber must see. Those rows take their project from `walcast.project` (set by
-- walcast for the joining project), and can never commit: see the constraint trigger
-- below. Everyone else's rows take the caller's project as before (0014).
CREATE OR REPLACE FUNCTION walcast.realtime_message_project()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p text;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.project IS NOT DISTINCT FROM OLD.project THEN
        RETURN NEW;
    END IF;
    IF walcast.is_check_login(session_user) THEN
        p := coalesce(nullif(current_setting('walcast.project', true), ''), 'default');
    ELSE
        p := walcast.caller_project();
    END IF;
    IF NEW.project IS NULL THEN
        NEW.project := p;
    ELSIF NEW.project <> p THEN
        RAISE EXCEPTION 'walcast: a realtime message of project % written for project % (set walcast.project)',
            quote_literal(NEW.project), quote_literal(p)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION walcast.realtime_message_project() FROM PUBLIC;

-- Rows written by a check login never commit, whoever holds its password.
CREATE OR REPLACE FUNCTION walcast.refuse_check_login_rows()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF walcast.is_check_login(session_user) THEN
        RAISE EXCEPTION 'walcast: the check login % writes nothing that commits', quote_ident(session_user)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION walcast.refuse_check_login_rows() FROM PUBLIC;

DROP TRIGGER IF EXISTS walcast_check_rows_never_commit ON realtime.messages;
CREATE CONSTRAINT TRIGGER walcast_check_rows_never_commit
    AFTER INSERT OR UPDATE ON realtime.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION walcast.refuse_check_login_rows();

-- The probe of a private channel's read check: a message of `topic` for the project in
-- `walcast.project`, inserted as the table's owner (so no policy judges the insert), for
-- the subscriber's SELECT to find. Executable by check logins only (granted at start).
CREATE OR REPLACE FUNCTION walcast.probe_message(topic text)
RETURNS uuid LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    id uuid;
BEGIN
    IF NOT walcast.is_check_login(session_user) THEN
        RAISE EXCEPTION 'walcast: only a check login probes channels'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    INSERT INTO realtime.messages (topic, extension, private, event, payload)
        VALUES (probe_message.topic, 'broadcast', true, 'walcast:authorize', '{}')
        RETURNING messages.id INTO id;
    RETURN id;
END
$$;
REVOKE ALL ON FUNCTION walcast.probe_message(text) FROM PUBLIC;

-- Each source's own check login (the default source's is CHECK_DATABASE_URL). Like its
-- other URLs, readable by walcast's role only.
ALTER TABLE walcast.sources ADD COLUMN IF NOT EXISTS check_url text;
