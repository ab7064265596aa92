-- A project's other verification keys: the previous HMAC secret (accepted during a
-- rotation) and a JWKS whose public keys verify RS/PS/ES/EdDSA user tokens by `kid`.
ALTER TABLE walcast.projects
    ADD COLUMN IF NOT EXISTS jwt_secret_previous text,
    ADD COLUMN IF NOT EXISTS jwks jsonb
        CHECK (jwks IS NULL OR jsonb_typeof(jwks -> 'keys') = 'array');
