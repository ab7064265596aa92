-- Per-project limits (README "Running a platform"): a project's connected-users limit,
-- set through the management API or `walcast project update --max-concurrent-users`.
-- NULL: the fronts' default (`PROJECT_MAX_USERS`). Lowering it ends no socket: only new
-- users are refused.
ALTER TABLE walcast.projects
    ADD COLUMN IF NOT EXISTS max_concurrent_users integer
        CHECK (max_concurrent_users IS NULL OR max_concurrent_users >= 0);
