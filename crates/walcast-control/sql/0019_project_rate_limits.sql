-- Per-project limits, the rest of the set (README "Running a platform"): joins per second,
-- channels per client, events and bytes per second, presence events per second and the
-- largest payload (KiB), each set through the management API or `walcast project update
-- --max-…`. NULL: the fronts' default. Nothing here ends a socket: a lowered limit only
-- refuses what comes after.
ALTER TABLE walcast.projects
    ADD COLUMN IF NOT EXISTS max_joins_per_second integer
        CHECK (max_joins_per_second IS NULL OR max_joins_per_second >= 0),
    ADD COLUMN IF NOT EXISTS max_channels_per_client integer
        CHECK (max_channels_per_client IS NULL OR max_channels_per_client >= 0),
    ADD COLUMN IF NOT EXISTS max_events_per_second integer
        CHECK (max_events_per_second IS NULL OR max_events_per_second >= 0),
    ADD COLUMN IF NOT EXISTS max_bytes_per_second integer
        CHECK (max_bytes_per_second IS NULL OR max_bytes_per_second >= 0),
    ADD COLUMN IF NOT EXISTS max_presence_events_per_second integer
        CHECK (max_presence_events_per_second IS NULL OR max_presence_events_per_second >= 0),
    ADD COLUMN IF NOT EXISTS max_payload_size_in_kb integer
        CHECK (max_payload_size_in_kb IS NULL OR max_payload_size_in_kb >= 0);
