-- The ws-fronts the leading cdc-worker has subscriptions from, kept by that leader as
-- fronts come and go. A worker that takes over waits for each of them to register its
-- subscriptions again before it reads the slot, even if a front is slow to answer (a
-- paused process, a loaded machine): otherwise the backlog it replays would be matched
-- without that front's subscriptions, and their clients would miss it.
CREATE TABLE IF NOT EXISTS walcast.fronts (
    front text        PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);
