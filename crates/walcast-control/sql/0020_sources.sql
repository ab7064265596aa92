-- Sources (README "Sources"): the databases walcast reads. 'default' is the deployment's
-- own DATABASE_URL (its URLs NULL here: they come from the configuration); every other
-- row is another database, read by a pipeline of its own with its own slot and lease.
-- Its URLs carry credentials, so, like the projects' secrets, nobody but walcast's own
-- role may read this table. Every database walcast reads has this table (the migrations
-- are the same everywhere); only the control database's (DATABASE_URL's) is used.
CREATE TABLE IF NOT EXISTS walcast.sources (
    name            text        PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_-]{0,29}$'),
    database_url    text,
    replication_url text,
    -- The slot's name on that database's server (unique: two sources may be databases
    -- of one server, whose slots share one namespace); NULL for the default (CDC_SLOT_NAME).
    slot_name       text        UNIQUE CHECK (slot_name ~ '^[a-z0-9_]{1,63}$'),
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((name = 'default') = (database_url IS NULL)),
    CHECK ((name = 'default') = (slot_name IS NULL))
);
REVOKE ALL ON walcast.sources FROM PUBLIC;
INSERT INTO walcast.sources (name) VALUES ('default') ON CONFLICT (name) DO NOTHING;

-- A project's schema is in its source's database; its row (keys, limits) stays here.
ALTER TABLE walcast.projects
    ADD COLUMN IF NOT EXISTS source text NOT NULL DEFAULT 'default'
        REFERENCES walcast.sources (name);
