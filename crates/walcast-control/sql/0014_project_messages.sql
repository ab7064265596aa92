-- realtime.messages by project (docs/security.md). Every row belongs to one project:
-- the project of the session that wrote it, `walcast.caller_project()` (the
-- `walcast.project` setting, default `default`, refused unless the session's login may
-- act for it: see 0012_trust.sql). The worker delivers a row's broadcast only to that
-- project's channels, and private-channel checks and replays read only the joining
-- project's rows, so no project can write into, or read, another project's topics.
--
-- Rows written before this migration belonged to the default project (the only one
-- database broadcasts were delivered to): they keep it.

ALTER TABLE realtime.messages ADD COLUMN IF NOT EXISTS project text NOT NULL DEFAULT 'default';
-- No default from now on: the trigger below sets it (NOT NULL is checked after it).
ALTER TABLE realtime.messages ALTER COLUMN project DROP DEFAULT;

-- Set a written row's project to the caller's; a project named explicitly must be the
-- caller's (an UPDATE may not move a row to another project either).
CREATE OR REPLACE FUNCTION walcast.realtime_message_project()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p text;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.project IS NOT DISTINCT FROM OLD.project THEN
        RETURN NEW;
    END IF;
    p := walcast.caller_project();
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

DROP TRIGGER IF EXISTS walcast_message_project ON realtime.messages;
CREATE TRIGGER walcast_message_project
    BEFORE INSERT OR UPDATE ON realtime.messages
    FOR EACH ROW EXECUTE FUNCTION walcast.realtime_message_project();

-- Replay and the private-channel checks read one project's topic since a time.
CREATE INDEX IF NOT EXISTS messages_project_topic_inserted_at_idx
    ON realtime.messages (project, topic, inserted_at);
