-- Projects besides the default one (id 'default', schema public, secret JWT_SECRET, not
-- stored here). Each has its own schema and the HS256 secret of its keys, so nobody but
-- walcast's own role may read this table.
CREATE TABLE IF NOT EXISTS walcast.projects (
    id          text        PRIMARY KEY CHECK (id <> 'default'),
    name        text        NOT NULL,
    schema_name text        NOT NULL UNIQUE,
    jwt_secret  text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON walcast.projects FROM PUBLIC;
